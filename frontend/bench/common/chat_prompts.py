"""W5's chat prompts: short everyday questions in the model's chat template."""

from __future__ import annotations

QUESTIONS = [
    "What is the capital of France, and what is it best known for?",
    "Write a short poem about the sea at night, with the moon shining on the waves.",
    "Give me three practical tips for someone who is learning to code for the first time.",
    "Explain in simple words why the sky is blue during the day and red at sunset.",
    "What are the main differences between a cat and a dog as a pet for a small flat?",
    "Describe how a bicycle works, from the pedals to the wheels, for a curious child.",
    "Summarise the story of Romeo and Juliet in a few sentences for a school report.",
    "How do plants turn sunlight into food? Please keep the answer short and clear.",
    "Suggest a healthy breakfast that I can prepare in under ten minutes before work.",
    "What should I pack for a weekend hiking trip in the mountains in early autumn?",
    "Explain what a computer's memory does and how it differs from its hard disk.",
    "Why do we have seasons on Earth? Mention the tilt of the axis in your answer.",
    "Tell me a fun fact about octopuses and explain why it is surprising to people.",
    "How can I become better at managing my time when studying for several exams?",
    "What is the difference between weather and climate? Give one example of each.",
    "Write a friendly email inviting my neighbours to a small garden party on Sunday.",
]
WARMUP_QUESTIONS = [
    "Say hello in French and in Spanish.",
    "Name three colours of the rainbow.",
]


def chat_prompts(tokenizer, questions: list[str]) -> list[list[int]]:
    prompts = []
    for q in questions:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        prompts.append([int(t) for t in ids])
    return prompts
