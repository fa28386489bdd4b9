"""Generated from protos/mirrorspec/v1 by scripts/gen_protos.py. Do not edit."""
