#compdef glmctl

_glmctl_completion() {
  eval $(env _TYPER_COMPLETE_ARGS="${words[1,$CURRENT]}" _GLMCTL_COMPLETE=complete_zsh glmctl)
}

compdef _glmctl_completion glmctl
