/**
 * The operator's drain switch on a running `shoal node`/`shoal serve`: SIGUSR2 toggles draining
 * (one line each way), and SIGTERM drains before the graceful stop. A real child process gets real
 * signals; its "daemon" records what it was told, in order.
 */
import { spawn } from 'node:child_process'
import { join } from 'node:path'
import { describe, expect, it } from 'vitest'
import { drainingLine, runUntilSignal } from '../../scripts/run-until-signal.ts'

const SCRIPT = `
import { runUntilSignal } from ${JSON.stringify(join(import.meta.dirname, '../../scripts/run-until-signal.ts'))}
let draining = false
const control = { drain (on = true) { draining = on; process.stdout.write('drain ' + on + '\\n') }, get draining () { return draining } }
// What a daemon's sockets do: keep the process alive until the stop.
const alive = setInterval(() => {}, 60_000)
const running = runUntilSignal(async () => { process.stdout.write('stop draining=' + draining + '\\n') }, () => 0, control)
process.stdout.write('ready\\n')
await running
clearInterval(alive)
process.stdout.write('done\\n')
`

describe('SIGUSR2 and SIGTERM on a running node', () => {
  it('SIGUSR2 toggles draining with one line each way; SIGTERM drains, then stops', async () => {
    const child = spawn(process.execPath, ['--input-type=module', '-e', SCRIPT], { stdio: ['ignore', 'pipe', 'pipe'] })
    let out = ''
    let err = ''
    const seen = async (text: string): Promise<void> => {
      const deadline = Date.now() + 20_000
      while (!out.includes(text)) {
        if (Date.now() > deadline) throw new Error(`timed out waiting for ${JSON.stringify(text)}; stdout ${out} stderr ${err}`)
        await new Promise(resolve => setTimeout(resolve, 20))
      }
    }
    child.stdout.on('data', (d: Buffer) => { out += d.toString() })
    child.stderr.on('data', (d: Buffer) => { err += d.toString() })
    const exited = new Promise<number | null>(resolve => child.on('exit', code => { resolve(code) }))
    try {
      await seen('ready\n')
      child.kill('SIGUSR2')
      await seen('drain true\n')
      child.kill('SIGUSR2')
      await seen('drain false\n')
      child.kill('SIGTERM')
      await seen('done\n')
      expect(await exited).toBe(0)
    } finally {
      child.kill('SIGKILL')
    }
    // Drain on, off, then on again before the stop ran.
    expect(out).toBe('ready\ndrain true\ndrain false\ndrain true\nstop draining=true\ndone\n')
    expect(err).toContain(drainingLine(true) + '\n' + drainingLine(false) + '\n')
    expect(drainingLine(true)).toBe('shoal: draining: on')
    expect(err).toMatch(/shoal: SIGTERM, stopping/)
  })

  // `shoal serve`, `node` and `demo` print their "up" lines after this call: a script or supervisor
  // that signals the moment it reads them must meet the graceful stop, not the default action
  // (a CI run once saw the demo killed by a SIGINT sent on its last line: exit code null).
  it('catches SIGINT and SIGTERM from the call on, before its promise is awaited', () => {
    const before = { SIGINT: process.listeners('SIGINT'), SIGTERM: process.listeners('SIGTERM') }
    void runUntilSignal(async () => {})
    const added = (signal: 'SIGINT' | 'SIGTERM'): Array<(...args: unknown[]) => void> =>
      process.listeners(signal).filter(l => !before[signal].includes(l)) as Array<(...args: unknown[]) => void>
    const [onInt, onTerm] = [added('SIGINT'), added('SIGTERM')]
    try {
      expect(onInt).toHaveLength(1)
      expect(onTerm).toHaveLength(1)
    } finally {
      for (const l of onInt) process.off('SIGINT', l)
      for (const l of onTerm) process.off('SIGTERM', l)
    }
  })
})
