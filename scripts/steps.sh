# Sourced by the set-up scripts: one line per step, the tools' own output kept in a log.
#
#   run_step "what it does" LOG_NAME COMMAND...
#
# runs COMMAND with its stdout and stderr in build/logs/LOG_NAME.log. On success it prints
# "what it does (N s)"; on failure the whole log goes to stderr, then one line naming the
# step, its exit status and the log, and run_step returns that status. pip's notices about
# this machine's package indexes, and its resolver's remarks on packages the tests do not
# import, stay in the log: a run that succeeds prints no ERROR or WARNING line of theirs.
LOSSAGG_LOG_DIR=${LOSSAGG_LOG_DIR:-build/logs}
mkdir -p "$LOSSAGG_LOG_DIR"

run_step() {
  local what=$1 log="$LOSSAGG_LOG_DIR/$2.log" start=$SECONDS rc=0
  shift 2
  "$@" >"$log" 2>&1 || rc=$?
  if [ "$rc" -eq 0 ]; then
    echo "$what ($((SECONDS - start)) s)"
  else
    cat "$log" >&2
    echo "FAILED: $what: exit status $rc after $((SECONDS - start)) s (output above, also in $log)" >&2
  fi
  return "$rc"
}

# pip as the set-up uses it: quiet about its own version, everything else into the step's log.
pip_install() { "${PY:-python3}" -m pip install --disable-pip-version-check "$@"; }
