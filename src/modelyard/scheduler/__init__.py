"""The scheduler: desired and actual placement state, the agents' gRPC service, the user API."""
