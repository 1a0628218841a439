/**
 * `shoal serve` as a user runs it: the real bin in a child process (`node scripts/shoal.mjs
 * serve …`), ready when it prints its "serving" line, answering the openai client, running with
 * the launcher's malloc tunables (glibc), and leaving cleanly (exit 0) on Ctrl-C. A missing model
 * directory is a one-line error with exit 2. A checkpoint is compiled with progress lines; Ctrl-C
 * drains a running request and says so. The CLI's edges: --version, unknown flags, shard's --out.
 */
import { spawn } from 'node:child_process'
import type { ChildProcess } from 'node:child_process'
import { mkdtemp, readFile, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { createInterface } from 'node:readline'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import OpenAI from 'openai'
import { MODEL_ID, freePort, makeTinyCheckpoint } from './daemon.ts'
import { DEFAULT_BUDGETS } from '../../daemon/node/index.ts'
import pkg from '../../package.json' with { type: 'json' }
import { MALLOC_TUNABLES, glibcVersion, mallocTunables } from '../../scripts/malloc.mjs'
import type { TinyCheckpoint } from './daemon.ts'

const BIN = join(import.meta.dirname, '..', '..', 'scripts', 'shoal.mjs')

let ck: TinyCheckpoint
let cache: string
const children: ChildProcess[] = []

beforeAll(async () => {
  ck = await makeTinyCheckpoint({ compile: true })
  cache = await mkdtemp(join(tmpdir(), 'shoal-e2e-cache-'))
})
afterAll(async () => {
  for (const c of children) if (c.exitCode === null && c.signalCode === null) c.kill('SIGKILL')
  await ck?.cleanup()
  await rm(cache, { recursive: true, force: true })
})

function shoal (args: string[], env: Record<string, string> = {}): { child: ChildProcess, stdout: () => string, stderr: () => string, exit: Promise<{ code: number | null, signal: NodeJS.Signals | null }> } {
  const child = spawn(process.execPath, [BIN, ...args], {
    env: { ...process.env, SHOAL_CACHE: cache, SHOAL_LOG_LEVEL: 'warn', ...env },
    stdio: ['ignore', 'pipe', 'pipe'],
  })
  children.push(child)
  let stderr = ''
  let stdout = ''
  child.stderr!.setEncoding('utf8').on('data', (s: string) => { stderr += s })
  child.stdout!.setEncoding('utf8').on('data', (s: string) => { stdout += s })
  const exit = new Promise<{ code: number | null, signal: NodeJS.Signals | null }>(resolve => child.once('exit', (code, signal) => resolve({ code, signal })))
  return { child, stdout: () => stdout, stderr: () => stderr, exit }
}

/** Resolves with the first stdout line that matches, or rejects at exit or after `ms`. */
async function lineMatching (child: ChildProcess, re: RegExp, ms: number): Promise<string> {
  const lines = createInterface({ input: child.stdout! })
  return await new Promise<string>((resolve, reject) => {
    const timer = setTimeout(() => { reject(new Error(`no line matching ${re} within ${ms} ms`)) }, ms)
    lines.on('line', (line) => { if (re.test(line)) { clearTimeout(timer); resolve(line) } })
    child.once('exit', (code) => { clearTimeout(timer); reject(new Error(`exited (${code}) before printing a line matching ${re}`)) })
  })
}

async function within<T> (promise: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined
  const deadline = new Promise<never>((_resolve, reject) => { timer = setTimeout(() => { reject(new Error(`${what} took over ${ms} ms`)) }, ms) })
  try {
    return await Promise.race([promise, deadline])
  } finally {
    clearTimeout(timer)
  }
}

describe('shoal serve (the CLI)', () => {
  it('serves a shard directory, answers the openai client, and exits 0 on SIGINT', async () => {
    const port = await freePort()
    const run = shoal(['serve', '--model', ck.shardDir, '--api', `127.0.0.1:${port}`, '--device', 'cpu'])
    const line = await lineMatching(run.child, /serving/, 60_000).catch((err: Error) => { throw new Error(`${err.message}; stderr: ${run.stderr()}`) })
    expect(line).toContain(`http://127.0.0.1:${port}/v1`)
    const baseURL = /(http:\/\/\S+\/v1)/.exec(line)![1]!
    const client = new OpenAI({ baseURL, apiKey: 'unused', maxRetries: 0, timeout: 30_000 })
    const { data, response } = await client.chat.completions.create({ model: MODEL_ID, messages: [{ role: 'user', content: 'hello' }], max_tokens: 8, temperature: 0 }).withResponse()
    expect(data.choices[0]!.finish_reason).toBe('length')
    expect(data.usage!.completion_tokens).toBe(8)
    expect(response.headers.get('x-shoal-route')).toBe(/\(node (\S+)\)/.exec(line)![1])
    // Alone, nothing can take work it refuses: its batch budget is the request's deadline, not the
    // mesh's 1 s (a burst queues instead of costing the openai client 429s).
    const metrics = await (await fetch(baseURL.replace(/\/v1$/, '/metrics'))).text()
    expect(metrics).toContain(`shoal_batch_config{batcher="${MODEL_ID}",setting="budget_seconds"} ${DEFAULT_BUDGETS.requestTimeoutMs / 1000}`)
    // Where the launcher's own decision asks for malloc tunables (glibc Linux, none set already), the
    // bin re-executed itself with them, same PID (scripts/malloc.mjs).
    const tunables = mallocTunables(['serve'], process.env.GLIBC_TUNABLES, { platform: process.platform, glibc: glibcVersion() })
    if (tunables !== undefined) {
      expect(tunables).toContain(MALLOC_TUNABLES)
      // glibc splits the variable at its colons in place as it parses it: look for each setting.
      const environ = await readFile(`/proc/${run.child.pid!}/environ`, 'utf8')
      expect(environ).toContain('GLIBC_TUNABLES=')
      for (const setting of tunables.split(':')) expect(environ).toContain(setting)
    }
    run.child.kill('SIGINT')
    const { code, signal } = await within(run.exit, 30_000, 'exiting after SIGINT')
    expect(signal).toBeNull()
    expect(code).toBe(0)
  })

  it('exits 2 with one line when the model directory does not exist', async () => {
    const missing = join(ck.root, 'no-such-model')
    const run = shoal(['serve', '--model', missing, '--api', '127.0.0.1:0', '--device', 'cpu'])
    const { code } = await within(run.exit, 60_000, 'failing')
    expect(code).toBe(2)
    const lines = run.stderr().split('\n').filter(l => l !== '')
    expect(lines).toHaveLength(1)
    expect(lines[0]).toMatch(/^shoal: /)
    expect(lines[0]).toContain(`${missing} does not exist`)
  })

  it('compiles a checkpoint with progress lines, says where its data is, and drains a running request on Ctrl-C', async () => {
    const port = await freePort()
    const data = join(cache, 'my-data')
    const run = shoal(['serve', '--model', ck.modelDir, '--api', `127.0.0.1:${port}`, '--device', 'cpu', '--data', data, '--log-format', 'human'], { SHOAL_LOG_LEVEL: 'info' })
    const dataLine = await lineMatching(run.child, /data in/, 60_000).catch((err: Error) => { throw new Error(`${err.message}; stderr: ${run.stderr()}`) })
    const line = run.stdout().split('\n').find(l => l.includes('serving'))!
    expect(dataLine).toBe(`  data in ${data} (check the receipts: shoal receipts verify --data ${data})`)
    // First use of a checkpoint: it is compiled, and the log says so and how far (human lines, not JSON).
    expect(run.stderr()).toMatch(/info  compiling the checkpoint into ONNX shards \(once, then cached\)/)
    expect(run.stderr()).toMatch(/info  compiling: 4\/4 layers, done in \d+\.\d s/)
    // A cache compile takes the per-head one-position attention whatever the CPU: every node
    // compiling this checkpoint arrives at the same manifest (shards/DESIGN.md).
    expect(run.stderr()).toMatch(/info  model loaded .*decodeAttention.*per-head/)
    expect(run.stderr()).not.toMatch(/^\{/m)
    const baseURL = /(http:\/\/\S+\/v1)/.exec(line)![1]!
    const client = new OpenAI({ baseURL, apiKey: 'unused', maxRetries: 0, timeout: 60_000 })
    const stream = await client.chat.completions.create({ model: MODEL_ID, messages: [{ role: 'user', content: 'hello' }], max_tokens: 600, temperature: 0, stream: true, stream_options: { include_usage: true } })
    let chunks = 0
    let usage: number | undefined
    for await (const chunk of stream) {
      if (chunks++ === 0) run.child.kill('SIGINT')
      if (chunk.usage != null) usage = chunk.usage.completion_tokens
    }
    // The running request finished (drained), then the process left cleanly.
    expect(usage).toBe(600)
    const { code } = await within(run.exit, 30_000, 'exiting after SIGINT')
    expect(code).toBe(0)
    expect(run.stderr()).toContain('shoal: SIGINT, draining 1 request (Ctrl-C again to force)')
  })
})

describe('shoal (the CLI) at its edges', () => {
  const quick = async (args: string[]): Promise<{ code: number | null, stdout: string, stderr: string }> => {
    const run = shoal(args)
    const { code } = await within(run.exit, 60_000, args.join(' '))
    return { code, stdout: run.stdout(), stderr: run.stderr() }
  }

  it('prints its version from package.json', async () => {
    const r = await quick(['--version'])
    expect(r.code).toBe(0)
    expect(r.stdout.trim()).toBe(pkg.version)
  })

  it('reports a mistyped flag as unknown, not as a missing required one', async () => {
    const r = await quick(['serve', '--modle', ck.shardDir])
    expect(r.code).toBe(2)
    expect(r.stderr.trim()).toMatch(/^shoal: unknown option '--modle'/)
    const missing = await quick(['serve'])
    expect(missing.code).toBe(2)
    expect(missing.stderr.trim()).toBe("shoal: required option '--model <dir>' not specified")
  })

  it('shard: a missing --model does not exist; an existing --out is refused without --force', async () => {
    const missing = await quick(['shard', '--model', join(ck.root, 'nope'), '--out', join(cache, 'out-x')])
    expect(missing.code).toBe(2)
    expect(missing.stderr.trim()).toBe(`shoal: --model ${join(ck.root, 'nope')} does not exist`)
    const out = join(cache, 'shards-once')
    const first = await quick(['shard', '--model', ck.modelDir, '--out', out])
    expect(first.code, first.stderr).toBe(0)
    expect(first.stderr).toMatch(/compiling .*: 4\/4 layers, done in/)
    const again = await quick(['shard', '--model', ck.modelDir, '--out', out])
    expect(again.code).toBe(2)
    expect(again.stderr.trim()).toBe(`shoal: --out ${out} already exists and is not empty; pass --force to replace it`)
    const forced = await quick(['shard', '--model', ck.modelDir, '--out', out, '--force', '--stages', '2'])
    expect(forced.code, forced.stderr).toBe(0)
    expect(forced.stdout).toContain('2 stage(s)')
  })
})
