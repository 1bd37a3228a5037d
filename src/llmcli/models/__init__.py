"""Models: a spec resolved to local files, loaded onto a device, sized, quantized, listed."""
