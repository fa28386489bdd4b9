"""The target replica: prefill, and one-pass verification with exact rejection sampling."""
