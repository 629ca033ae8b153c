"""The deploy/ files (compose, Procfile, Kubernetes) and the probes they rely on."""
