"""The grader box's service: grade a finished group read from Postgres and store its grades.

The graders themselves (`rlpipe.graders`) are pure: a task and a response in, a reward out.
"""
