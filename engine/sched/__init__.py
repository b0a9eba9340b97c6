"""Scheduling: requests, admission checks, the scheduler, the paged-KV block manager. No torch here."""
