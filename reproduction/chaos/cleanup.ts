/**
 * Undo steps that must run however the suite ends: normal exit, an exception, Ctrl-C (SIGINT),
 * SIGTERM or SIGHUP. Steps are synchronous (killing a child, `ip netns del`) because an `exit`
 * handler cannot wait for promises; they run newest first, each once, and a failing step does not
 * stop the others. A network namespace outlives its name while a process still runs in it, so the
 * cluster registers "kill my children" after the hosts register "delete the namespaces".
 */

type Step = () => void

const steps: Step[] = []
let installed = false

function runAll (): void {
  while (steps.length > 0) {
    const step = steps.pop()!
    try {
      step()
    } catch {}
  }
}

function install (): void {
  if (installed) return
  installed = true
  process.once('exit', runAll)
  // Under vitest the worker's signals are the runner's business; the exit handler is enough there.
  if (process.env.VITEST !== undefined) return
  for (const signal of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const) {
    process.once(signal, () => {
      process.stderr.write(`chaos: ${signal}, cleaning up\n`)
      runAll()
      process.exit(signal === 'SIGINT' ? 130 : 143)
    })
  }
}

/** Registers an undo step; returns a function that runs it now (once) and unregisters it. */
export function onCleanup (step: Step): () => void {
  install()
  let done = false
  const once: Step = () => {
    if (done) return
    done = true
    step()
  }
  steps.push(once)
  return () => {
    const i = steps.indexOf(once)
    if (i >= 0) steps.splice(i, 1)
    once()
  }
}
