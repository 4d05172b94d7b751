"""RewardModel (rlasync/rewards/model/): a tiny random sequence-classification reward model scored through the core
scorer equals a direct `model(**tokenizer(texts))` call on the same rendered texts; rendering uses the reward
model's own tokenizer and chat template; length-sorted micro-batches come back in the original order; what
`reward_funcs` accepts (a folder, a loaded model, a hub id that is not local) and its errors."""

import asyncio
import json
import pickle

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WORDS = [str(d) for d in range(10)] + "What is + = ? . Answer user assistant system good bad".split()
TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def tiny_tokenizer(padding_side="right", chat_template=TEMPLATE, pad=True):
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<pad>", "<eos>", "<unk>", "<|im_start|>", "<|im_end|>", "<bos>"]
    vocab = {token: i for i, token in enumerate(specials + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>" if pad else None,
        eos_token="<eos>",
        unk_token="<unk>",
        chat_template=chat_template,
        padding_side=padding_side,
    )


def tiny_reward_model(num_labels=1, seed=0, pad_token_id=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=6 + len(WORDS),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_labels=num_labels,
        pad_token_id=pad_token_id,
        eos_token_id=1,
        bos_token_id=None,
    )
    return transformers.AutoModelForSequenceClassification.from_config(config).eval()


def save_tiny_reward_model(path, *, num_labels=1, padding_side="right", chat_template=TEMPLATE, seed=0):
    """A random 2-layer Llama with a classification head, saved with its tokenizer; returns the folder as a str."""
    tiny_reward_model(num_labels, seed).save_pretrained(path)
    tiny_tokenizer(padding_side, chat_template).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return save_tiny_reward_model(tmp_path_factory.mktemp("tiny_rm"), padding_side="left")


PROMPTS = [
    [{"role": "user", "content": "What is 2 + 3 ?"}],
    [{"role": "system", "content": "Answer"}, {"role": "user", "content": "What is 12 + 30 + 4 + 4 ?"}],
    [{"role": "user", "content": "What is 1 ?"}],
]
COMPLETIONS = [
    [{"role": "assistant", "content": "5"}],
    [{"role": "assistant", "content": "good 5 0 . 5 0 bad bad 1 2 3 4"}],
    [{"role": "assistant", "content": "Answer 1 1 1"}],
]


def direct_logits(model, tokenizer, texts, add_special_tokens):
    """The reference: one unpadded forward per text (what a batch must reproduce) and the tokenizer's own
    right-padded batch."""
    singles = [
        model(**tokenizer(text, return_tensors="pt", add_special_tokens=add_special_tokens)).logits[0, 0].item()
        for text in texts
    ]
    tokenizer.padding_side = "right"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=add_special_tokens)
    return singles, model(**batch).logits[:, 0].tolist()


def test_scores_equal_a_direct_model_call_on_the_rendered_texts(rm_dir):
    from rlasync.rewards import RewardModel

    reward = RewardModel(rm_dir, batch_size=2, device="cpu")
    scorer = reward.load()
    assert scorer.tokenizer.padding_side == "left"  # saved left-padded: the scorer pads right anyway
    rendered = [scorer.render(p, c) for p, c in zip(PROMPTS, COMPLETIONS)]
    texts = [text for text, _ in rendered]
    assert texts[0] == "<|im_start|> user What is 2 + 3 ? <|im_end|> <|im_start|> assistant 5 <|im_end|> "
    assert all(special is False for _, special in rendered)  # the template's tokens, none added
    model = transformers.AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(rm_dir)
    with torch.no_grad():
        singles, batched = direct_logits(model, tokenizer, texts, add_special_tokens=False)
    got = asyncio.run(reward(prompts=PROMPTS, completions=COMPLETIONS))
    assert got == pytest.approx(singles, abs=1e-5)
    assert got == pytest.approx(batched, abs=1e-5)
    assert len(set(round(v, 4) for v in got)) == 3  # three different texts, three different scores


def test_length_sorted_micro_batches_come_back_in_the_original_order(rm_dir):
    from rlasync.rewards import RewardModel

    scorer = RewardModel(rm_dir, batch_size=2, device="cpu").load()
    texts = ["1", "What is 2 + 3 ? 5 5 5 5 5", "good", "What is 9 + 9 ? 18 bad", "7 7 7"]
    ids = [scorer.encode(text, True) for text in texts]
    batches = scorer.micro_batches([len(i) for i in ids])
    assert batches == [[1, 3], [4, 0], [2]]  # longest first, two per forward
    one_by_one = [scorer.score_texts([text])[0] for text in texts]
    assert scorer.score_texts(texts) == pytest.approx(one_by_one, abs=1e-5)
    assert scorer.score_texts(texts[::-1]) == pytest.approx(one_by_one[::-1], abs=1e-5)


def test_plain_text_prompts_and_a_template_override(tmp_path):
    from rlasync.rewards import RewardModel

    folder = save_tiny_reward_model(tmp_path / "plain", chat_template=None)
    scorer = RewardModel(folder, device="cpu").load()
    assert scorer.render("What is 2 + 3 ?", [{"role": "assistant", "content": " 5"}]) == ("What is 2 + 3 ? 5", True)
    assert scorer.render(PROMPTS[0], COMPLETIONS[0]) == ("What is 2 + 3 ?5", True)  # no template: plain text
    custom = RewardModel(folder, device="cpu", template=lambda p, c: f"Answer {c[-1]['content']}").load()
    assert custom.render(PROMPTS[0], COMPLETIONS[0]) == ("Answer 5", True)
    jinja = RewardModel(folder, device="cpu", template="{% for m in messages %}{{ m['content'] }} {% endfor %}")
    assert jinja.load().render(PROMPTS[0], COMPLETIONS[0]) == ("What is 2 + 3 ? 5 ", False)


def test_two_label_head_uses_the_last_label_unless_told(tmp_path):
    from rlasync.rewards import RewardModel

    folder = save_tiny_reward_model(tmp_path / "two", num_labels=2)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        logits = model(**tokenizer("good 5", return_tensors="pt")).logits[0]
    assert RewardModel(folder, device="cpu").load().score_texts(["good 5"]) == pytest.approx([logits[1].item()])
    first = RewardModel(folder, device="cpu", label_index=0).load()
    assert first.score_texts(["good 5"]) == pytest.approx([logits[0].item()])
    with pytest.raises(ValueError, match="label_index=2 but the reward model's head has 2 label"):
        RewardModel(folder, device="cpu", label_index=2).load()


def test_a_loaded_model_travels_as_config_and_weights(rm_dir):
    from rlasync.rewards import RewardModel
    from rlasync.rewards.model import as_reward_model

    model = transformers.AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    reward = as_reward_model(model)
    assert isinstance(reward, RewardModel) and reward.__name__ == rm_dir.rsplit("/", 1)[-1]
    with torch.no_grad():
        model.score.weight.mul_(3.0)  # the object's weights as they are now, not the folder's
    reward = RewardModel(model, device="cpu")
    copy = pickle.loads(pickle.dumps(reward))
    got = asyncio.run(copy(prompts=PROMPTS, completions=COMPLETIONS))
    texts = [copy._scorer.render(p, c)[0] for p, c in zip(PROMPTS, COMPLETIONS)]
    tokenizer = transformers.AutoTokenizer.from_pretrained(rm_dir)
    with torch.no_grad():
        singles, _ = direct_logits(model, tokenizer, texts, add_special_tokens=False)
    assert got == pytest.approx(singles, abs=1e-5)
    assert copy.drain_metrics() and copy.drain_metrics() == []  # recorded once, drained once


def test_what_reward_funcs_accepts_and_refuses(tmp_path, rm_dir):
    from rlasync.rewards.model import as_reward_model, reward_model_folder

    assert as_reward_model(rm_dir).source == rm_dir
    assert as_reward_model(len) is None
    with pytest.raises(ValueError, match="not download models at run time"):
        reward_model_folder("no-such-org/no-such-reward-model")
    causal = tmp_path / "causal"
    causal.mkdir()
    (causal / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(ValueError, match="not a sequence classifier"):
        reward_model_folder(causal)
    with pytest.raises(ValueError, match="no config.json"):
        reward_model_folder(tmp_path)
    lm = transformers.AutoModelForCausalLM.from_config(tiny_reward_model().config)
    with pytest.raises(ValueError, match="not a sequence-classification reward model"):
        as_reward_model(lm)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "batch_size=0 must be a positive integer"),
        ({"dtype": "fp8"}, "dtype='fp8' must be one of"),
        ({"device": "tpu"}, "device='tpu' must be one of"),
        ({"max_wait_s": -1}, "max_wait_s=-1 must be seconds"),
        ({"template": 3}, "template=3 must be a Jinja chat template string or a function"),
        ({"name": ""}, "name='' must be a non-empty string"),
    ],
)
def test_bad_settings_name_the_field(rm_dir, kwargs, message):
    from rlasync.rewards import RewardModel

    with pytest.raises(ValueError, match=message):
        RewardModel(rm_dir, **kwargs)


def test_trainer_turns_a_folder_into_a_reward_model_on_a_reward_actor(rm_dir):
    from rlasync import AsyncGRPOConfig, AsyncGRPOTrainer, RewardModel
    from rlasync.data import arithmetic_dataset

    def digits(completions, **kwargs):
        return [0.0 for _ in completions]

    config = AsyncGRPOConfig(output_dir="unused", max_steps=1)
    assert config.cluster.num_reward_actors == 0
    trainer = AsyncGRPOTrainer(
        model="unused", reward_funcs=[rm_dir, digits], args=config, train_dataset=arithmetic_dataset(8, seed=0)
    )
    assert isinstance(trainer.reward_funcs[0], RewardModel) and trainer.reward_funcs[1] is digits
    assert config.cluster.num_reward_actors == 1  # a reward model is scored in the RewardActor pool
    with pytest.raises(ValueError, match="not download models at run time"):
        AsyncGRPOTrainer(
            model="unused", reward_funcs="org/rm", args=config, train_dataset=arithmetic_dataset(8, seed=0)
        )


def test_reward_num_gpus_is_checked_and_asked_of_ray():
    from rlasync.config import AsyncGRPOConfig
    from rlasync.driver import actor_requests

    config = AsyncGRPOConfig(output_dir="unused", cluster={"num_reward_actors": 2, "reward_num_gpus": 0.25})
    assert actor_requests(config.cluster)["reward"] == (2, config.cluster.reward_num_cpus, 0.25)
    assert AsyncGRPOConfig(output_dir="unused", cluster={"reward_num_gpus": 2}).cluster.reward_num_gpus == 2
    for bad, message in ((-0.5, "must be >= 0"), (1.5, "whole number of GPUs")):
        with pytest.raises(ValueError, match=rf"cluster.reward_num_gpus={bad}.*{message}"):
            AsyncGRPOConfig(output_dir="unused", cluster={"reward_num_gpus": bad})


def test_rollout_actors_get_a_copy_without_the_loaded_weights(rm_dir):
    from rlasync import AsyncGRPOConfig, AsyncGRPOTrainer, RewardModel
    from rlasync.data import arithmetic_dataset

    model = transformers.AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    config = AsyncGRPOConfig(output_dir="unused", max_steps=1)
    trainer = AsyncGRPOTrainer(
        model="unused", reward_funcs=model, args=config, train_dataset=arithmetic_dataset(8, seed=0)
    )
    (full,) = trainer.reward_funcs
    (light,) = trainer._loop_kwargs()["reward_funcs"]
    assert isinstance(full, RewardModel) and full.source["state_dict"]  # the RewardActor pool gets the weights
    assert light.source is None and light.__name__ == full.__name__
    assert len(pickle.dumps(light)) * 20 < len(pickle.dumps(full))
    with pytest.raises(RuntimeError, match="carries no weights.*scored in the RewardActor pool"):
        asyncio.run(light(prompts=PROMPTS, completions=COMPLETIONS))
    assert RewardModel(rm_dir).without_weights().source == rm_dir  # a folder is kept: it weighs nothing


def test_a_run_file_takes_a_reward_model_folder(tmp_path, rm_dir):
    from rlasync.rewards import last_number_reward
    from rlasync.runfile import load_run

    text = (
        "model: tiny/model\ndataset: {name: arithmetic, size: 8, seed: 1}\n"
        f"reward_funcs: [{rm_dir}, rlasync.rewards:last_number_reward]\n"
    )
    (tmp_path / "run.yaml").write_text(text)
    assert load_run(tmp_path / "run.yaml", []).build_reward_funcs() == [rm_dir, last_number_reward]
    (tmp_path / "bad.yaml").write_text(text.replace(rm_dir, str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="import strings 'module:function'.*or folders of reward models"):
        load_run(tmp_path / "bad.yaml", [])
