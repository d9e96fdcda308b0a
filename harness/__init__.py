"""What the scripts and the tests use to drive tandem, and the product never imports: starting and
stopping its processes (procs), free ports (net), made-up adapters (adapters), small runs (runs)."""
