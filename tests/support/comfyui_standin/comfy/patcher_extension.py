class CallbacksMP:
    ON_PREPARE_STATE = "on_prepare_state"
    ON_CLEANUP = "on_cleanup"
