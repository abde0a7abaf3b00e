"""The parts of a training stage's loop (stage_loop.train_stage): each a small object with the hooks it needs and,
where it holds state, state_dict / load_state_dict; a checkpoint saves the dict of the parts' states."""
