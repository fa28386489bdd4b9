"""mirrorspec on Ray: replicas as actors, a detached controller that owns the two pools, and the
``ray up`` configs beside this package. Ray does placement, lifecycle, discovery and scaling; the
data plane stays gRPC, so the servers do not know they run in actors."""
