"""What the tests share, in one place: composing configs and running p3d as a user does (runs.py), gloo process
groups from one forkserver (dist.py), the documented command lines (documented.py), and small helpers of one
topic each. Test modules import from here, never from one another or from a conftest."""
