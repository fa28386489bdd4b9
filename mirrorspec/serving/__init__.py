"""Pieces every mirrorspec gRPC server shares: errors and their status codes, sessions, servers."""
