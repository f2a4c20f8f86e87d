"""jobs/e2e.py's workloads: what a method trains, on which batches, and how it is evaluated.

- ``LMWork`` (``--workload lm``): the GPT-style byte-level transformer (jobs/models.py ``GPT``) on the
  Python standard library's source, split by file; the validation loss in nats per byte, with the
  count-based n-gram losses of the same split on the same predictions (jobs/ngram.py) in ``info``.
- ``CNNWork`` (``--workload cnn``): the digits CNN at width 48; the test cross-entropy, accuracy beside.

Each has ``defaults`` (the run's flags it sets where the command line does not), ``info`` (fields of
the setup record), ``model()``, ``batch_at(step)`` (the same batch of ``step`` whichever came before),
``loss(model, x, y)`` and ``evaluate(model, comm)`` (collective).

Example::

    from e2e_workloads import WORKLOADS
    wl = WORKLOADS["lm"](args, rank, P)
    x, y = wl.batch_at(0)
    wl.loss(wl.model(), x, y).backward()
"""


class LMWork:
    name = "lm"
    defaults = {"batch": 8, "optimizer": "adamw", "lr": 1e-3, "clip": 1.0, "schedule": "cosine", "steps": 600,
                "momentum": 0.9, "weight_decay": 0.1, "lr_warmup": 30}

    def __init__(self, args, rank, nranks):
        import models

        self.seed, self.rank = args.seed, rank
        self.dims = dict(d_model=args.d_model, layers=args.layers, heads=args.heads, context=args.context)
        train, val = models.stdlib_corpus()
        self.data = models.TextData(train, val, seq=args.context, val_windows=args.val_windows, val_seq=args.context)
        self.batch = args.batch
        self.info = {"model": "GPT " + ", ".join(f"{k} {v}" for k, v in self.dims.items()),
                     "data": "stdlib *.py, split by file", "corpus": models.corpus_id(train, val),
                     "val_predictions": int(self.data.val_y.numel())}
        # the floor a target must be below (count models of the same split, on the same predictions)
        import ngram
        from mpi4py import MPI

        base = ngram.baselines(train, self.data.val_x.numpy(), self.data.val_y.numpy()) if rank == 0 else None
        self.info["ngram"] = MPI.COMM_WORLD.bcast(base)

    def model(self):
        import models

        return models.GPT(**self.dims)

    def batch_at(self, step):
        return self.data.batch(step, self.batch, self.seed, self.rank)

    def loss(self, model, x, y):
        import models

        return models.text_loss(model, x, y)

    def evaluate(self, model, comm):
        import models

        return {"val_loss": models.text_val_loss(model, self.data, comm)}


class CNNWork:
    name = "cnn"
    defaults = {"batch": 32, "optimizer": "sgd", "lr": 0.1, "clip": 0.0, "schedule": "constant", "steps": 264,
                "momentum": 0.9, "weight_decay": 1e-4, "lr_warmup": 0}

    def __init__(self, args, rank, nranks):
        import models
        from mpi4py import MPI

        self.seed, self.rank, self.batch = args.seed, rank, args.batch
        self.data = models.digits(args.seed, rank, nranks)
        shard = MPI.COMM_WORLD.allreduce(self.data.x_train.shape[0], op=MPI.MIN)
        self.per_epoch = max(1, shard // self.batch)
        self._next, self._it = None, None
        self.info = {"model": "DigitsCNN width 48", "data": "sklearn digits, 20 % test",
                     "steps_per_epoch": self.per_epoch}

    def model(self):
        import models

        return models.DigitsCNN(width=48)

    def batch_at(self, step):
        """The batch of ``step``, the same whichever steps came before (each method starts at 0)."""
        epoch, pos = divmod(step, self.per_epoch)
        if (epoch, pos) != self._next:
            self._it = self.data.batches(epoch, self.batch, self.per_epoch, self.seed, self.rank)
            for _ in range(pos):
                next(self._it)
        self._next = (epoch, pos + 1) if pos + 1 < self.per_epoch else None
        return next(self._it)

    def loss(self, model, x, y):
        import torch

        return torch.nn.functional.cross_entropy(model(x), y)

    def evaluate(self, model, comm):
        import models

        acc, loss = models.evaluate(model, self.data, comm)
        return {"val_loss": loss, "val_acc": acc}


WORKLOADS = {"lm": LMWork, "cnn": CNNWork}
