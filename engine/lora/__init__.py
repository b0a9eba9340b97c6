"""Multi-LoRA: PEFT adapters read and checked, held in host memory and in fixed GPU slots, and the
LoRA layers that add each row's adapter to the base projections (docs/lora.md)."""
