"""Suite-wide settings.

torch runs one thread in the test process: the distributed tests fork worker
processes, and a forked child deadlocks if the parent has already started a
multi-threaded OpenMP pool (see FIELD-NOTES).  It also makes float results
independent of the thread count.
"""

import torch

torch.set_num_threads(1)
