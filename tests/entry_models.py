"""The models and batches that tests/mpi/test_entry_contract.py trains through the torch entry points.

Tiny on purpose (a step takes milliseconds), but of the kinds users train: an MLP, a CNN with
BatchNorm (conv-bn-relu twice, a linear head) and a two-layer GPT-2 from ``transformers`` with tied
embeddings. Every batch is a function of (step, rank) only, so a run can be repeated bit for bit
and any rank can compute another rank's batch. torch is imported by the caller first (the test
module skips without it); ``transformers`` only where a GPT is built.
"""
import torch

VOCAB, SEQ = 64, 16


def mlp(seed=0, width=24, extra=False):
    """Linear-Tanh-Linear-Tanh-Linear; ``extra``: one more parameter, on the outer module (unused)."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
                              torch.nn.Tanh(), torch.nn.Linear(width, 4))
    if extra:
        net.register_parameter("extra", torch.nn.Parameter(torch.randn(3)))
    return net


def mlp_batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=g) * (1 + step % 3), torch.randint(0, 4, (16,), generator=g)


class SmallCNN(torch.nn.Module):
    """conv-bn-relu x2 and a linear head, on 3 x 8 x 8 images, 5 classes."""

    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
            torch.nn.Conv2d(4, 6, 3, padding=1, stride=2), torch.nn.BatchNorm2d(6), torch.nn.ReLU())
        self.head = torch.nn.Linear(6 * 4 * 4, 5)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def cnn(seed=0):
    torch.manual_seed(seed)
    return SmallCNN()


def cnn_batch(step, rank):
    g = torch.Generator().manual_seed(7000 + 1000 * step + rank)
    # each rank's images have their own mean and spread: its BatchNorm statistics differ from the others'
    x = torch.randn(8, 3, 8, 8, generator=g) * (1 + 0.5 * rank) + 0.3 * rank
    return x, torch.randint(0, 5, (8,), generator=g)


def gpt2_config():
    """Two layers of width 32, no dropout (every rank and every repeat computes the same bits)."""
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0,
                      eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def gpt2(seed=0):
    """``GPT2LMHeadModel`` with its output layer tied to the token embedding."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(gpt2_config())
    assert model.lm_head.weight is model.transformer.wte.weight, "the embeddings are not tied"
    return model


class GPTWithExtras(torch.nn.Module):
    """The GPT plus what real models carry: a module never called in ``forward`` (its parameters
    never get a gradient) and a frozen parameter (``requires_grad=False``, a logit bias that is
    used). ``forward(ids)`` returns the next-token loss."""

    def __init__(self, seed=0):
        super().__init__()
        self.lm = gpt2(seed)
        self.unused = torch.nn.Linear(5, 3)
        self.logit_bias = torch.nn.Parameter(torch.randn(VOCAB) * 0.01, requires_grad=False)

    def forward(self, ids):
        logits = self.lm(input_ids=ids).logits + self.logit_bias
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def param_groups(model, weight_decay):
    """Two groups over every parameter of ``model`` (the frozen one included, as users pass them):
    matrices decay, biases and LayerNorm weights do not."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def token_batch(step, rank, batch=4):
    g = torch.Generator().manual_seed(3000 + 1000 * step + rank)
    return torch.randint(0, VOCAB, (batch, SEQ), generator=g)
