"""Mesh-to-mesh reshard: which box of a tensor goes from which rank to which, and the transfer itself."""
