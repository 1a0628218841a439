/**
 * reproduction/lib/malloc.ts: a benchmark that hosts an engine re-executes itself once with `shoal
 * serve`'s malloc settings (same PID), and leaves an operator's own malloc tunables alone; and every
 * benchmark that hosts an engine does so.
 */
import { spawnSync } from 'node:child_process'
import { mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { pathToFileURL } from 'node:url'
import { afterAll, describe, expect, it } from 'vitest'
import { glibcVersion, MALLOC_TUNABLES } from '../../scripts/malloc.mjs'

const dir = mkdtempSync(join(tmpdir(), 'shoal-bench-malloc-'))
const script = join(dir, 'probe.ts')
const lib = pathToFileURL(join(import.meta.dirname, '../../reproduction/lib/malloc.ts')).href
writeFileSync(script, [
  `import { execWithServeMalloc, mallocSettings } from '${lib}'`,
  'const before = process.env.SHOAL_PROBE_PID ?? String(process.pid)',
  'process.env.SHOAL_PROBE_PID = before',
  'execWithServeMalloc()',
  'console.log(JSON.stringify({ first: before, pid: process.pid, tunables: process.env.GLIBC_TUNABLES ?? null, settings: mallocSettings() }))',
].join('\n'))
afterAll(() => { rmSync(dir, { recursive: true, force: true }) })

function probe (env: Record<string, string | undefined>): { first: string, pid: number, tunables: string | null, settings: string } {
  const { GLIBC_TUNABLES: _, ...rest } = process.env
  const run = spawnSync(process.execPath, [script, '--an-argument'], { env: { ...rest, ...env }, encoding: 'utf8' })
  expect(run.status, run.stderr).toBe(0)
  const lines = run.stdout.trim().split('\n')
  expect(lines).toHaveLength(1)
  return JSON.parse(lines[0]!)
}

// Where glibc or process.execve is missing there is nothing to re-execute with.
const canExec = process.platform === 'linux' && glibcVersion() !== undefined && typeof process.execve === 'function'

describe('execWithServeMalloc', () => {
  it.runIf(canExec)('re-executes once with shoal serve\'s malloc settings, in the same process', () => {
    const out = probe({})
    expect(out.tunables).toBe(MALLOC_TUNABLES)
    expect(out.settings).toBe(`GLIBC_TUNABLES=${MALLOC_TUNABLES}`)
    expect(String(out.pid)).toBe(out.first)
  })

  it('leaves malloc tunables an operator set as they are', () => {
    const out = probe({ GLIBC_TUNABLES: 'glibc.malloc.check=0' })
    expect(out.tunables).toBe('glibc.malloc.check=0')
    expect(out.settings).toBe('GLIBC_TUNABLES=glibc.malloc.check=0')
  })
})

// A benchmark hosts an engine when it makes one of these: then it times an engine under glibc's
// malloc defaults unless it asks for serve's settings (wave 32: +0.1–0.3 ms a sampled step).
const HOSTS_AN_ENGINE = /\b(createStageEngine|createLocalService|createStageRunner|createOnnxruntimeBackend|benchDaemon|loopbackNode|openPipeline|createExpertHolder|createDaemon|InferenceSession)\b/
// Scripts that make one and need not ask, and why.
const EXEMPT: Record<string, string> = {
  'check-batch-bits.ts': 'compares bits, which malloc cannot change, and times nothing',
  'check-verify-rounding.ts': 'compares bits, which malloc cannot change, and times nothing',
  'expert-holder-process.ts': "a child of bench-experts.ts, which inherits that script's settings",
}

describe('benchmarks that host an engine', () => {
  const dir = join(import.meta.dirname, '../../reproduction')
  const hosts = readdirSync(dir).filter(f => f.endsWith('.ts') && HOSTS_AN_ENGINE.test(readFileSync(join(dir, f), 'utf8')))

  it('are found (the pattern still matches the benchmarks)', () => {
    expect(hosts).toContain('bench-engine.ts')
    expect(hosts).toContain('bench-batching.ts')
  })

  it.each(hosts.filter(f => EXEMPT[f] === undefined))('%s runs it under shoal serve\'s malloc settings', f => {
    const src = readFileSync(join(dir, f), 'utf8')
    expect(/^execWithServeMalloc\(\)$/m.test(src) || /\bserveMallocEnv\(\)/.test(src)).toBe(true)
  })
})
