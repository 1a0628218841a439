/**
 * Crash safety: a child process appends under load and prints every acknowledged id; it is
 * SIGKILLed at random moments (during open, mid-batch, between batches), several times over the same
 * log. After each kill the log verifies from entry 0 and every acknowledged id is in it.
 */
import { spawn } from 'node:child_process'
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, expect, it } from 'vitest'
import { createLedger } from '../../daemon/ledger/index.ts'
import { receiptsVerify } from '../../scripts/commands/receipts.ts'
import { makeSigner, seedOf } from './fixtures/keys.ts'

const CHILD = join(import.meta.dirname, 'fixtures', 'append-child.ts')
const SEED = seedOf(0x42)
const ROUNDS = 6
let dir: string

beforeAll(async () => { dir = await mkdtemp(join(tmpdir(), 'shoal-crash-')) })
afterAll(async () => { await rm(dir, { recursive: true, force: true }) })

function rng (seed: number): () => number {
  let s = seed >>> 0
  return () => { s = (Math.imul(s, 1664525) + 1013904223) >>> 0; return s / 2 ** 32 }
}

interface Run { acked: string[], stderr: string, exit: { code: number | null, signal: string | null } }

/** Spawns the child and SIGKILLs it after `afterAcks` acknowledgements, or `afterMs` after spawn. */
async function runAndKill (round: number, kill: { afterAcks?: number, afterMs?: number }): Promise<Run> {
  const child = spawn(process.execPath, [CHILD, dir, Buffer.from(SEED).toString('hex'), `k${round}`], { stdio: ['ignore', 'pipe', 'pipe'] })
  const acked: string[] = []
  let stderr = ''
  let partial = ''
  const exited = new Promise<Run['exit']>((resolve) => child.on('exit', (code, signal) => { resolve({ code, signal }) }))
  let fire: () => void = () => {}
  const killed = new Promise<void>((resolve) => { fire = resolve })
  child.stderr.on('data', (d: Buffer) => { stderr += d.toString() })
  child.stdout.on('data', (d: Buffer) => {
    const lines = (partial + d.toString()).split('\n')
    partial = lines.pop()!
    for (const line of lines) if (line !== 'started') acked.push(line)
    if (kill.afterAcks !== undefined && acked.length >= kill.afterAcks) fire()
  })
  const timer = setTimeout(fire, kill.afterMs ?? 30_000) // the deadline doubles as the random moment
  await Promise.race([killed, exited])
  clearTimeout(timer)
  child.kill('SIGKILL')
  const exit = await exited
  return { acked, stderr, exit }
}

it(`the log survives ${ROUNDS} SIGKILLs under load with every acknowledged receipt`, async () => {
  const rand = rng(0xc0ffee)
  const signer = makeSigner(SEED)
  const allAcked: string[] = []
  for (let round = 0; round < ROUNDS; round++) {
    // Alternate: kill after a random number of acknowledgements, or at a random time since spawn (possibly during open).
    const kill = round % 2 === 0 ? { afterAcks: 1 + Math.floor(rand() * 80) } : { afterMs: 150 + Math.floor(rand() * 600) }
    const run = await runAndKill(round, kill)
    expect(run.exit.signal, `child died on its own: ${run.stderr}`).toBe('SIGKILL')
    allAcked.push(...run.acked)

    const ledger = createLedger({ dataDir: dir, signer })
    await ledger.start()
    try {
      const report = await ledger.verify()
      expect(report, `round ${round} (${JSON.stringify(kill)})`).toMatchObject({ ok: true })
      for (const id of allAcked) expect(await ledger.get(id), `acknowledged ${id} missing after round ${round}`).toBeDefined()
      expect(report.entries).toBeGreaterThanOrEqual(allAcked.length)
    } finally {
      await ledger.stop()
    }
  }
  expect(allAcked.length).toBeGreaterThan(0)
  expect((await receiptsVerify({ data: dir }, () => {})).ok).toBe(true)
}, 180_000)
