"""The test process itself runs torch on one thread. It computes references and runs small fits
in-process (the Lightning callback's calibration, a predictor) while the ranks it starts hold the
cores; with a second thread each of its parallel regions waited out a time slice whenever a rank
had the other core, which made those tests' times swing with whatever else ran."""

import torch

torch.set_num_threads(1)
