"""Native CPU kernels built on the machine that runs them (see ``native``)."""
