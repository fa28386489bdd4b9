"""The orchestrator: the client-facing GenerationService, driving drafters and targets over gRPC."""
