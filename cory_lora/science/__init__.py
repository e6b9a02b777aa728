"""The science: studies of many runs (`study`), their reports (`report`), figures (`plots`) and
held-out evaluation of a finished run (`evaluate`)."""
