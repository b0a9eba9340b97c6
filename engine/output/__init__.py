"""From sampled tokens to outputs: forced tokens, stops, text, records for the core, the calculator tool."""
