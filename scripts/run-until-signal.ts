/**
 * Keeps a started daemon (or a group of them) alive until SIGINT/SIGTERM, then stops it
 * gracefully, saying how many requests it waits for; a second signal exits at once. With a
 * `drain` control, SIGUSR2 toggles draining (an operator's maintenance: peers send no new work,
 * what runs finishes, kept KV stays pullable), and SIGINT/SIGTERM drain before the stop.
 */
export { cliLogger } from './logging.ts'

/** The line printed on the first signal. */
export function stoppingLine (signal: string, inFlight: number): string {
  if (inFlight === 0) return `shoal: ${signal}, stopping (again to force)`
  return `shoal: ${signal}, draining ${inFlight} request${inFlight === 1 ? '' : 's'} (Ctrl-C again to force)`
}

/** The line printed when SIGUSR2 toggles draining. */
export function drainingLine (on: boolean): string {
  return `shoal: draining: ${on ? 'on' : 'off'}`
}

/** A daemon's drain switch (Daemon.drain / Daemon.draining). */
export interface DrainControl {
  drain: (on?: boolean) => void
  readonly draining: boolean
}

/**
 * Catches the signals from the call on (the handlers are in place when it returns its promise),
 * which resolves once the daemon has stopped: call it before saying the process is up.
 */
export async function runUntilSignal (stop: () => Promise<void>, inFlight: () => number = () => 0, drain?: DrainControl): Promise<void> {
  const onUsr2 = (): void => {
    if (drain === undefined) return
    drain.drain(!drain.draining)
    process.stderr.write(drainingLine(drain.draining) + '\n')
  }
  if (drain !== undefined) process.on('SIGUSR2', onUsr2)
  await new Promise<void>((resolve) => {
    let stopping = false
    const onSignal = (signal: NodeJS.Signals): void => {
      if (stopping) {
        process.stderr.write(`shoal: ${signal} again, exiting now\n`)
        process.exit(130)
      }
      stopping = true
      // Peers hear `accepting: false` at their next load poll while in-flight requests finish.
      drain?.drain(true)
      process.stderr.write(stoppingLine(signal, inFlight()) + '\n')
      stop().then(resolve, (err: unknown) => {
        process.stderr.write(`shoal: stop failed: ${(err as Error).message}\n`)
        resolve()
      })
    }
    process.on('SIGINT', onSignal)
    process.on('SIGTERM', onSignal)
  })
  process.off('SIGUSR2', onUsr2)
}
