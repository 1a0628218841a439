/**
 * Keeps a started daemon (or a group of them) alive until SIGINT/SIGTERM, then stops it
 * gracefully; a second signal exits at once.
 */
import { pino } from 'pino'
import type { Logger } from 'pino'

export function cliLogger (): Logger {
  // Structured logs go to stderr so stdout stays for the lines a person or script reads.
  return pino({ level: process.env.SHOAL_LOG_LEVEL ?? 'info' }, pino.destination(2))
}

export async function runUntilSignal (stop: () => Promise<void>): Promise<void> {
  await new Promise<void>((resolve) => {
    let stopping = false
    const onSignal = (signal: NodeJS.Signals): void => {
      if (stopping) {
        process.stderr.write(`shoal: ${signal} again, exiting now\n`)
        process.exit(130)
      }
      stopping = true
      process.stderr.write(`shoal: ${signal}, stopping (again to force)\n`)
      stop().then(resolve, (err: unknown) => {
        process.stderr.write(`shoal: stop failed: ${(err as Error).message}\n`)
        resolve()
      })
    }
    process.on('SIGINT', onSignal)
    process.on('SIGTERM', onSignal)
  })
}
