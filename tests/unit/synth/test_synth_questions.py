"""Questions: reproducible, closed small vocabulary of lowercase ASCII words, balanced enough."""

import re
from collections import Counter

from epd.synth.questions import (
    ANSWER_VOCAB,
    IMAGE_QUESTION_TYPES,
    VIDEO_QUESTION_TYPES,
    make_questions,
    tokenizer_words,
)
from epd.synth.scene import generate_image_scene, generate_scene


def test_vocabulary_is_small_and_lowercase_ascii():
    assert len(ANSWER_VOCAB) == len(set(ANSWER_VOCAB)) <= 30
    assert all(re.fullmatch(r"[a-z]+", w) for w in ANSWER_VOCAB)
    words = tokenizer_words()
    assert set(ANSWER_VOCAB) <= set(words)
    assert all(re.fullmatch(r"[a-z]+", w) for w in words)


def test_same_seed_same_questions():
    assert make_questions(generate_scene(42)) == make_questions(generate_scene(42))
    assert make_questions(generate_scene(42)) != make_questions(generate_scene(43))


def test_questions_over_many_scenes_are_well_formed_and_use_every_answer():
    answers: Counter = Counter()
    by_type: dict[str, Counter] = {}
    for seed in range(400):
        scene = generate_scene(seed)
        qas = make_questions(scene)
        types = [qa.question_type for qa in qas]
        assert len(types) == len(set(types)) and set(types) <= set(VIDEO_QUESTION_TYPES)
        for qa in qas:
            assert qa.answer in ANSWER_VOCAB
            assert qa.question == qa.question.lower() and qa.question.endswith("?")
            assert re.fullmatch(r"[a-z ]+\?", qa.question), qa.question
            answers[qa.answer] += 1
            by_type.setdefault(qa.question_type, Counter())[qa.answer] += 1
        image_types = [qa.question_type for qa in make_questions(generate_image_scene(seed))]
        assert set(image_types) <= set(IMAGE_QUESTION_TYPES)
    assert set(answers) == set(ANSWER_VOCAB)
    # No question type is dominated by one answer (a model could not learn it from the video).
    for qtype, counts in by_type.items():
        assert max(counts.values()) < 0.7 * sum(counts.values()), (qtype, counts)


def test_colour_question_names_a_shape_only_one_object_has():
    for seed in range(200):
        scene = generate_scene(seed)
        for qa in make_questions(scene):
            if qa.question_type == "colour":
                shape = qa.question.split()[-1].rstrip("?")
                assert [o.colour for o in scene.objects if o.shape == shape] == [qa.answer]
