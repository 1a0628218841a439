/**
 * `shoal serve` as a user runs it: the real bin in a child process (`node scripts/shoal.mjs
 * serve …`), ready when it prints its "serving" line, answering the openai client, and leaving
 * cleanly (exit 0) on Ctrl-C. A missing model directory is a one-line error with exit 2.
 */
import { spawn } from 'node:child_process'
import type { ChildProcess } from 'node:child_process'
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { createInterface } from 'node:readline'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import OpenAI from 'openai'
import { MODEL_ID, freePort, makeTinyCheckpoint } from './daemon.ts'
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

function shoal (args: string[]): { child: ChildProcess, stderr: () => string, exit: Promise<{ code: number | null, signal: NodeJS.Signals | null }> } {
  const child = spawn(process.execPath, [BIN, ...args], {
    env: { ...process.env, SHOAL_CACHE: cache, SHOAL_LOG_LEVEL: 'warn' },
    stdio: ['ignore', 'pipe', 'pipe'],
  })
  children.push(child)
  let stderr = ''
  child.stderr!.setEncoding('utf8').on('data', (s: string) => { stderr += s })
  const exit = new Promise<{ code: number | null, signal: NodeJS.Signals | null }>(resolve => child.once('exit', (code, signal) => resolve({ code, signal })))
  return { child, stderr: () => stderr, exit }
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
    expect(lines[0]).toContain(missing)
  })
})
