/**
 * The benchmarks' shoal child processes (reproduction/lib/processes.ts), on the real CLI: ready on
 * the stdout line asked for, and a rejection naming the process when it exits first.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createShoalProcesses } from '../../reproduction/lib/index.ts'

describe('reproduction shoal processes', () => {
  let cache: string
  beforeAll(async () => { cache = await mkdtemp(join(tmpdir(), 'shoal-repro-proc-')) })
  afterAll(async () => { await rm(cache, { recursive: true, force: true }) })

  it('resolves once a stdout line is accepted, and rejects when the process exits first', async () => {
    const daemons = createShoalProcesses()
    const child = await daemons.spawn('help', ['--help'], undefined, cache, line => line.startsWith('Usage: shoal'))
    expect(child.pid).toBeGreaterThan(0)
    await expect(daemons.spawn('help again', ['--help'], undefined, cache, () => false)).rejects.toThrow(/^help again exited \(0\)/)
    await daemons.stop(undefined, 2_000)
    expect(child.exitCode !== null || child.signalCode !== null).toBe(true)
  }, 30_000)
})
