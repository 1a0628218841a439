/**
 * The two OpenAI servers a comparison starts, one child process at a time: llama-server and
 * `shoal serve`, each under RT when this process is realtime (see realtime.ts), ready once it
 * answers HTTP, its peak RSS read from /proc before it is stopped.
 */
import type { ChildProcess } from 'node:child_process'
import { readFileSync } from 'node:fs'
import { createServer } from 'node:net'
import { join, resolve } from 'node:path'
import { performance } from 'node:perf_hooks'
import { createInterface } from 'node:readline'
import { setTimeout as sleep } from 'node:timers/promises'
import type { NativeKernels } from './native-kernels.ts'
import { SHOAL_BIN } from './processes.ts'
import { spawnRt } from './realtime.ts'

/** A running server: where to send requests, under which model name; `startMs` from spawn to ready. */
export interface Server { kind: 'llama' | 'shoal', url: string, model: string, child: ChildProcess, startMs: number }

/** A first start loads (shoal: and may compile) the model; on a loaded 2-core machine that takes minutes. */
const READY_BOUND_MS = 300_000

async function freePort (): Promise<number> {
  return await new Promise((resolve, reject) => {
    const s = createServer()
    s.once('error', reject)
    s.listen(0, '127.0.0.1', () => {
      const port = (s.address() as { port: number }).port
      s.close(() => { resolve(port) })
    })
  })
}

function tailOf (child: ChildProcess): () => string {
  let err = ''
  const keep = (b: Buffer): void => { err = (err + b.toString()).slice(-4000) }
  child.stderr?.on('data', keep)
  return () => err
}

async function waitHttp (url: string, ok: (status: number, body: string) => boolean, child: ChildProcess, tail: () => string, boundMs: number): Promise<void> {
  const until = Date.now() + boundMs
  for (;;) {
    if (child.exitCode !== null || child.signalCode !== null) throw new Error(`server exited (${child.exitCode ?? child.signalCode}): ${tail()}`)
    try {
      const res = await fetch(url, { signal: AbortSignal.timeout(5000) })
      if (ok(res.status, await res.text())) return
    } catch { /* not up yet */ }
    if (Date.now() > until) throw new Error(`${url} not ready within ${boundMs} ms: ${tail()}`)
    await sleep(100)
  }
}

/** `bin`/llama-server with `argsFor(port)` on a free loopback port, ready once /health answers 200. */
export async function startLlama (bin: string, model: string, argsFor: (port: number) => string[], env: NodeJS.ProcessEnv): Promise<Server> {
  const port = await freePort()
  const t = performance.now()
  const child = spawnRt(join(bin, 'llama-server'), argsFor(port), { stdio: ['ignore', 'ignore', 'pipe'], env })
  const tail = tailOf(child)
  const url = `http://127.0.0.1:${port}`
  await waitHttp(`${url}/health`, s => s === 200, child, tail, READY_BOUND_MS)
  return { kind: 'llama', url, model, child, startMs: performance.now() - t }
}

/**
 * `shoal serve` on `shards` with no prefix cache (`--kv-cache-mb 0`: every prompt prefilled cold,
 * as llama-server's are), SHOAL_CACHE=`cache`; ready once /v1/models lists `model`. To compare
 * two versions or environments side by side: `bin`, the CLI of another checkout; `env`, variables
 * set for this server over this process's own.
 */
export async function startShoal (shards: string, model: string, cache: string, extra: string[], { bin = SHOAL_BIN, env = {} }: { bin?: string, env?: Record<string, string> } = {}): Promise<Server> {
  const t = performance.now()
  const child = spawnRt(process.execPath, [bin, 'serve', '--model', shards, '--api', '127.0.0.1:0', '--device', 'cpu', '--kv-cache-mb', '0', ...extra],
    { stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, ...env, SHOAL_CACHE: cache } })
  const tail = tailOf(child)
  const url = await new Promise<string>((resolve, reject) => {
    const timer = setTimeout(() => { reject(new Error(`shoal serve did not start within 300 s: ${tail()}`)) }, READY_BOUND_MS)
    child.once('exit', code => { clearTimeout(timer); reject(new Error(`shoal serve exited (${code}): ${tail()}`)) })
    createInterface({ input: child.stdout! }).on('line', line => {
      const match = /^shoal: serving \S+ at (\S+)\/v1/.exec(line)
      if (match !== null) { clearTimeout(timer); resolve(match[1]!) }
    })
  })
  await waitHttp(`${url}/v1/models`, (s, body) => s === 200 && body.includes(model), child, tail, READY_BOUND_MS)
  return { kind: 'shoal', url, model, child, startMs: performance.now() - t }
}

/**
 * One side of a shoal-against-shoal comparison (ab-serve-env.ts, paired-vs-llamacpp.ts): the
 * server of a checkout (`dir`; this one when absent), on a shard (`shard`; the run's when absent),
 * with variables added to its environment (`env`) and arguments to its command line (`args`,
 * e.g. ["--draft", "none"]).
 */
export interface ShoalArm {
  env?: Record<string, string>
  dir?: string
  shard?: string
  args?: string[]
  /**
   * The benchmark kernels of daemon/engine/native/ort-kernels.c, preloaded, on shards
   * compiled for them (lib/arms.ts startArm): true or 'attention' the 'native' one-position
   * attention, 'int4' the int4 products (MatMulQ4), 'both' the two.
   */
  native?: boolean | NativeKernels
}

/** An arm as the scripts take it in JSON: its environment's variables alone, or a ShoalArm. */
export function shoalArm (given: Record<string, string> | ShoalArm): ShoalArm {
  return ['env', 'dir', 'shard', 'args', 'native'].some(k => k in given) ? given as ShoalArm : { env: given as Record<string, string> }
}

/** `shoal serve` for `arm` (see startShoal), on its own shard or `shard`. */
export async function startShoalArm (arm: ShoalArm, shard: string, model: string, cache: string): Promise<Server> {
  const bin = arm.dir === undefined ? undefined : join(resolve(arm.dir), 'scripts', 'shoal.mjs')
  return await startShoal(arm.shard ?? shard, model, cache, arm.args ?? [], { env: arm.env ?? {}, ...(bin === undefined ? {} : { bin }) })
}

/** The child's peak resident set (VmHWM) in bytes; NaN once it is gone, so read it before `stop`. */
export function peakRss (child: ChildProcess): number {
  try {
    const m = /VmHWM:\s+(\d+) kB/.exec(readFileSync(`/proc/${child.pid}/status`, 'utf8'))
    return m === null ? NaN : Number(m[1]) * 1024
  } catch { return NaN }
}

/** SIGTERM, and SIGKILL after 10 s: the next server must not start beside this one's threads. */
export async function stop (s: Server): Promise<void> {
  if (s.child.exitCode !== null || s.child.signalCode !== null) return
  const exited = new Promise<void>(resolve => { s.child.once('exit', () => { resolve() }) })
  s.child.kill('SIGTERM')
  if (await Promise.race([exited.then(() => true), sleep(10_000).then(() => false)])) return
  s.child.kill('SIGKILL')
  await exited
}
