"""Kubernetes manifests for a build spec and its plan (``specbuild k8s render``)."""
