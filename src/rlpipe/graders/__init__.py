"""Graders: turn a task and the policy's final message into a validated reward in [0, 1].

`graders.base` holds the interface and `InvalidGrade`, `graders.rules` the rule-based graders,
`graders.judge` the LLM judge, `graders.cache` cache keys and `grade_with_cache`, and
`graders.registry` the name -> class map.
"""
