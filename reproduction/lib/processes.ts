/**
 * The `shoal` daemons a benchmark starts as child processes: each optionally pinned to a core with
 * `taskset -c`, ready once its stdout shows what the caller waits for, and stopped SIGTERM first.
 */
import { spawn } from 'node:child_process'
import type { ChildProcess } from 'node:child_process'
import { createInterface } from 'node:readline'
import { setTimeout as sleep } from 'node:timers/promises'
import { fileURLToPath } from 'node:url'

/** The shoal CLI of this checkout. */
export const SHOAL_BIN = fileURLToPath(new URL('../../scripts/shoal.mjs', import.meta.url))

/** How long a daemon may take to say it is ready (a first run compiles and loads the model). */
const START_BOUND_MS = 180_000

export interface ShoalProcesses {
  /**
   * Starts `shoal ARGV` (under `taskset -c CORE` when `core` is set, with SHOAL_CACHE=cacheDir) and
   * resolves once `ready` accepts a line of its stdout; rejects, with the tail of its stderr, when
   * it exits first or is not ready within 180 s.
   */
  spawn (name: string, argv: string[], core: number | undefined, cacheDir: string, ready: (line: string) => boolean): Promise<ChildProcess>
  /** SIGTERMs `which` (default: every one still running), SIGKILLs what is alive after `boundMs`, and waits up to `boundMs` more. */
  stop (which?: ChildProcess[], boundMs?: number): Promise<void>
}

export function createShoalProcesses (): ShoalProcesses {
  const running = new Set<ChildProcess>()
  const alive = (c: ChildProcess): boolean => c.exitCode === null && c.signalCode === null
  return {
    async spawn (name, argv, core, cacheDir, ready) {
      const full = [SHOAL_BIN, ...argv]
      const [cmd, cmdArgs] = core === undefined ? [process.execPath, full] : ['taskset', ['-c', String(core), process.execPath, ...full]]
      const child = spawn(cmd, cmdArgs, { stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, SHOAL_CACHE: cacheDir } })
      running.add(child)
      child.once('exit', () => { running.delete(child) })
      let err = ''
      child.stderr!.on('data', (b: Buffer) => { err = (err + b.toString()).slice(-4000) })
      const lines = createInterface({ input: child.stdout! })
      return await new Promise((resolve, reject) => {
        const timer = setTimeout(() => { reject(new Error(`${name} did not start within ${START_BOUND_MS / 1000} s: ${err}`)) }, START_BOUND_MS)
        const onExit = (code: number | null): void => { clearTimeout(timer); reject(new Error(`${name} exited (${code}): ${err}`)) }
        child.once('exit', onExit)
        lines.on('line', line => {
          if (ready(line)) { clearTimeout(timer); child.off('exit', onExit); resolve(child) }
        })
      })
    },

    async stop (which = [...running], boundMs = 5000) {
      const live = which.filter(alive)
      const exited = Promise.all(live.map(c => new Promise<void>(resolve => { c.once('exit', () => { resolve() }) })))
      for (const c of live) c.kill('SIGTERM')
      if (await Promise.race([exited.then(() => true), sleep(boundMs).then(() => false)])) return
      for (const c of live) if (alive(c)) c.kill('SIGKILL')
      await Promise.race([exited, sleep(boundMs)])
    },
  }
}
