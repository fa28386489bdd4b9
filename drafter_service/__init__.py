"""The drafter replica: sessions with their own KV caches; commit-then-draft."""
