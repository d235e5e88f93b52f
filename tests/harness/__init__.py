"""What drives a real local mesh, shared by the integration tests and the load-test tools: meshes
on free ports and second Envoys (meshes.py), the chaos scenarios (chaos.py), the health-check
and slow-consumer probes. loadtests/ imports from here; tests import nothing from loadtests/
(tests/unit/test_test_imports.py)."""
