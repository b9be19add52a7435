"""`bema sweep`: walk (the step-major states) and run (the driver: plan, engine, records)."""
