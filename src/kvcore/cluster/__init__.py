"""kvcore replicas on Ray Serve behind a router that routes on the replicas' cached block chains.

The routing logic (`index`, `policy`, `autoscale`) is plain Python; only the modules that build the
Ray Serve application import `ray` (the optional extra `kvcore[cluster]`)."""
