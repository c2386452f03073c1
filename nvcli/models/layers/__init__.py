"""Building blocks shared by every architecture; all tensor-parallel aware."""
