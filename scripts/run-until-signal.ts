/**
 * Keeps a started daemon (or a group of them) alive until SIGINT/SIGTERM, then stops it
 * gracefully, saying how many requests it waits for; a second signal exits at once.
 */
export { cliLogger } from './logging.ts'

/** The line printed on the first signal. */
export function stoppingLine (signal: string, inFlight: number): string {
  if (inFlight === 0) return `shoal: ${signal}, stopping (again to force)`
  return `shoal: ${signal}, draining ${inFlight} request${inFlight === 1 ? '' : 's'} (Ctrl-C again to force)`
}

export async function runUntilSignal (stop: () => Promise<void>, inFlight: () => number = () => 0): Promise<void> {
  await new Promise<void>((resolve) => {
    let stopping = false
    const onSignal = (signal: NodeJS.Signals): void => {
      if (stopping) {
        process.stderr.write(`shoal: ${signal} again, exiting now\n`)
        process.exit(130)
      }
      stopping = true
      process.stderr.write(stoppingLine(signal, inFlight()) + '\n')
      stop().then(resolve, (err: unknown) => {
        process.stderr.write(`shoal: stop failed: ${(err as Error).message}\n`)
        resolve()
      })
    }
    process.on('SIGINT', onSignal)
    process.on('SIGTERM', onSignal)
  })
}
