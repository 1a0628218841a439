/**
 * The start-up warm-up (daemon/node/warm-up.ts): a real daemon on the tiny model warms up before
 * it listens, and leaves no receipt, no request metric and no kept prefix behind; its answers are
 * token for token those of a daemon that did not warm up. After it listens it settles (decodes
 * while idle) until its tokens are done, a request comes or it stops.
 */
import { join } from 'node:path'
import { Writable } from 'node:stream'
import { pino } from 'pino'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { settleVerdict, WARM_UP, warmUp, warmUpGoesOn, warmUpRequests } from '../../daemon/node/warm-up.ts'
import type { WarmUpEngine } from '../../daemon/node/warm-up.ts'
import { makeTinyCheckpoint, MODEL_ID, startDaemon } from '../e2e/daemon.ts'
import type { RunningDaemon, TinyCheckpoint } from '../e2e/daemon.ts'

describe('warmUpRequests', () => {
  it('asks for the completions of WARM_UP, a chat second, all streamed and greedy', () => {
    const requests = warmUpRequests({ id: 'm', contextLength: 4096 })
    expect(requests.map(r => r.url)).toEqual(['/v1/completions', '/v1/chat/completions', '/v1/completions', '/v1/completions'])
    for (const r of requests) expect(r.body).toMatchObject({ model: 'm', stream: true, temperature: 0 })
    const completions = requests.filter(r => r.url === '/v1/completions')
    expect(completions.map(r => [(r.body.prompt as number[]).length, r.body.max_tokens])).toEqual(WARM_UP.completions)
    expect(requests[1]!.body.max_tokens).toBe(WARM_UP.chatTokens)
    const ids = completions.flatMap(r => r.body.prompt as number[])
    expect(Math.min(...ids)).toBeGreaterThanOrEqual(3)
    expect(Math.max(...ids)).toBeLessThan(259)
  })

  it('fits a short context: each prompt and each answer within a quarter of it', () => {
    const requests = warmUpRequests({ id: 'm', contextLength: 32 })
    expect(requests.filter(r => r.url === '/v1/completions').map(r => [(r.body.prompt as number[]).length, r.body.max_tokens])).toEqual([[8, 4], [8, 8], [8, 8]])
    expect(requests[1]!.body.max_tokens).toBe(8)
  })
})

describe('warmUp\'s report', () => {
  it('counts a request its budget cut as cut, not failed', async () => {
    // A stand-in engine that answers nothing until the request is aborted: what a cold 250m int4
    // node's first request (weights still on disk) was to the 1 s budget.
    const silent: WarmUpEngine = {
      models: () => [{ id: 'silent', contextLength: 4096 } as ReturnType<WarmUpEngine['models']>[number]],
      generate: (_request, signal) => (async function * () {
        await new Promise(resolve => signal.addEventListener('abort', resolve, { once: true }))
        throw signal.reason
      })(),
      decodeStepMs: () => 0,
    }
    const lines: Array<{ msg?: string, completed?: number, cut?: number, failed?: number }> = []
    const report = await warmUp([silent], pino({ level: 'info' }, new Writable({ write (chunk: Buffer, _enc, done) { lines.push(JSON.parse(chunk.toString())); done() } })), { ...WARM_UP, budgetMs: 300 })
    expect(report).toMatchObject({ completed: 0, cut: 1, failed: 0 })
    expect(lines.filter(l => l.msg === 'warmed up')).toEqual([expect.objectContaining({ completed: 0, cut: 1, failed: 0 })])
  })
})

describe('warmUpGoesOn', () => {
  it('goes on within the budget', () => {
    expect(warmUpGoesOn(0, undefined)).toBe(true)
    expect(warmUpGoesOn(WARM_UP.budgetMs - 1, 10)).toBe(true)
  })
  it('stops at the budget', () => {
    expect(warmUpGoesOn(WARM_UP.budgetMs, 10)).toBe(false)
  })
  it('stops on a model whose decode step is slower than slowStepMs', () => {
    expect(warmUpGoesOn(0, WARM_UP.slowStepMs)).toBe(true)
    expect(warmUpGoesOn(0, WARM_UP.slowStepMs + 1)).toBe(false)
  })
})

describe('settleVerdict', () => {
  const idle = { elapsedMs: 0, tokens: 0, others: 0, stepMs: 2 }
  it('goes on while the node is idle, within the budget and the tokens, or before a step is measured', () => {
    expect(settleVerdict(idle)).toBeUndefined()
    expect(settleVerdict({ ...idle, stepMs: 0 })).toBeUndefined()
    expect(settleVerdict({ ...idle, elapsedMs: WARM_UP.settle.budgetMs - 1, tokens: WARM_UP.settle.tokens - 1 })).toBeUndefined()
  })
  it('ends at once when another request is in flight, before anything else', () => {
    expect(settleVerdict({ ...idle, others: 1 })).toBe('request')
    expect(settleVerdict({ ...idle, others: 1, elapsedMs: WARM_UP.settle.budgetMs, tokens: WARM_UP.settle.tokens })).toBe('request')
  })
  it('ends at the budget', () => {
    expect(settleVerdict({ ...idle, elapsedMs: WARM_UP.settle.budgetMs })).toBe('budget')
  })
  it('moves to the next engine when this one has its tokens or its steps are slower than slowStepMs', () => {
    expect(settleVerdict({ ...idle, tokens: WARM_UP.settle.tokens })).toBe('next')
    expect(settleVerdict({ ...idle, stepMs: WARM_UP.slowStepMs + 1 })).toBe('next')
    expect(settleVerdict({ ...idle, stepMs: WARM_UP.slowStepMs })).toBeUndefined()
  })
})

interface Completion { ids: number[], reused: string | null, receipt: string | null }

async function complete (d: RunningDaemon, prompt: number[]): Promise<Completion> {
  const res = await fetch(`${d.url}/v1/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ model: MODEL_ID, prompt, max_tokens: 16, temperature: 0, return_token_ids: true }),
    signal: AbortSignal.timeout(60_000),
  })
  const body = await res.json() as { choices: Array<{ token_ids: number[] }> }
  expect(res.status).toBe(200)
  return { ids: body.choices[0]!.token_ids, reused: res.headers.get('x-shoal-prefix-reused'), receipt: res.headers.get('x-shoal-receipt') }
}

describe('a daemon with warmUp', () => {
  let ckpt: TinyCheckpoint
  let warm: RunningDaemon
  let plain: RunningDaemon
  let brief: RunningDaemon
  type Line = { msg?: string, completed?: number, failed?: number, tokens?: number, ended?: string }
  const logs: Line[] = []
  const briefLogs: Line[] = []
  const logTo = (lines: Line[]): Writable => new Writable({ write (chunk: Buffer, _enc, done) { lines.push(JSON.parse(chunk.toString())); done() } })

  beforeAll(async () => {
    ckpt = await makeTinyCheckpoint({ compile: true })
    // WARM_UP's requests with bounds no loaded machine reaches: every request runs (the bounds
    // themselves are warmUpGoesOn's, above).
    warm = await startDaemon(ckpt.shardDir, join(ckpt.root, 'warm'), { warmUp: { ...WARM_UP, budgetMs: 60_000, slowStepMs: Infinity, settle: { tokens: 64, budgetMs: 60_000 } } }, pino({ level: 'info' }, logTo(logs)))
    plain = await startDaemon(ckpt.shardDir, join(ckpt.root, 'plain'))
    // Every step is slower than 0 ms: the engine's measured step stops it after the first request.
    brief = await startDaemon(ckpt.shardDir, join(ckpt.root, 'brief'), { warmUp: { ...WARM_UP, budgetMs: 60_000, slowStepMs: 0 } }, pino({ level: 'info' }, logTo(briefLogs)))
  }, 120_000)

  afterAll(async () => {
    await warm?.stop()
    await plain?.stop()
    await brief?.stop()
    await ckpt?.cleanup()
  })

  it('ran every warm-up request before it started listening', () => {
    expect(logs.filter(l => l.msg === 'warmed up')).toEqual([expect.objectContaining({ completed: warmUpRequests({ id: MODEL_ID, contextLength: 4096 }).length, failed: 0 })])
  })

  it('stops after the first request on a model whose measured step is slower than slowStepMs', () => {
    expect(briefLogs.filter(l => l.msg === 'warmed up')).toEqual([expect.objectContaining({ completed: 1, failed: 0 })])
  })

  it('settles after it listens: decodes its tokens, then ends', async () => {
    await until(() => logs.some(l => l.msg === 'settled'))
    const [settled] = logs.filter(l => l.msg === 'settled')
    expect(settled).toMatchObject({ ended: 'done' })
    expect(settled!.tokens).toBeGreaterThanOrEqual(64)
  })

  it('does not settle a model whose measured step is slower than slowStepMs', async () => {
    // The settle decides at once after listening; the log would be there by now.
    await until(() => logs.some(l => l.msg === 'settled'))
    expect(briefLogs.filter(l => l.msg === 'settled')).toEqual([])
  })

  it('left no receipt, no request metric and no kept prefix', async () => {
    const state = await (await fetch(`${warm.url}/dashboard/state`)).json() as { requests: unknown[] }
    expect(state.requests).toEqual([])
    const metrics = await (await fetch(`${warm.url}/metrics`)).text()
    expect(metrics).not.toMatch(/^shoal_http_requests_total\{[^}]*completions/m)
    expect(metrics).not.toMatch(/^shoal_tokens_generated_total\{[^}]*\} [1-9]/m)
    expect(metrics).not.toMatch(/^shoal_kv_prefix_(bytes|miss_tokens_total)\{[^}]*\} [1-9]/m)
  })

  it('answers token for token as a daemon that did not warm up, reusing nothing of the warm-up', async () => {
    const models = await (await fetch(`${warm.url}/v1/models`)).json() as { data: Array<{ id: string, context_length: number }> }
    const request = warmUpRequests({ id: MODEL_ID, contextLength: models.data[0]!.context_length }).at(-1)
    // The warm-up's own prompt and more: a kept warm-up prefix would be reused here.
    const prompt = [...request!.body.prompt as number[], 7, 8, 9]
    const a = await complete(warm, prompt)
    const b = await complete(plain, prompt)
    expect(a.ids).toEqual(b.ids)
    expect(a.ids.length).toBeGreaterThan(0)
    expect(a.reused).toBeNull()
    expect(a.receipt).not.toBeNull()
    const state = await (await fetch(`${warm.url}/dashboard/state`)).json() as { requests: unknown[] }
    expect(state.requests).toHaveLength(1)
  })
})

describe('a daemon settling', () => {
  let ckpt: TinyCheckpoint
  let plain: RunningDaemon
  type Line = { msg?: string, tokens?: number, ended?: string }
  const logTo = (lines: Line[]): Writable => new Writable({ write (chunk: Buffer, _enc, done) { lines.push(JSON.parse(chunk.toString())); done() } })
  /** A settle no machine finishes within a test: only a request or a stop ends it. */
  const endless = { warmUp: { ...WARM_UP, budgetMs: 60_000, slowStepMs: Infinity, settle: { tokens: 1e9, budgetMs: 600_000 } } }

  beforeAll(async () => {
    ckpt = await makeTinyCheckpoint({ compile: true })
    plain = await startDaemon(ckpt.shardDir, join(ckpt.root, 'plain'))
  }, 120_000)

  afterAll(async () => {
    await plain?.stop()
    await ckpt?.cleanup()
  })

  it('stops at a request, which answers token for token as on a daemon that never settled', async () => {
    const logs: Line[] = []
    const d = await startDaemon(ckpt.shardDir, join(ckpt.root, 'asked'), endless, pino({ level: 'info' }, logTo(logs)))
    try {
      await decoding(d)
      const prompt = [5, 6, 7, 8, 9, 10, 11, 12]
      const a = await complete(d, prompt)
      expect(a.ids).toEqual((await complete(plain, prompt)).ids)
      await until(() => logs.some(l => l.msg === 'settled'))
      const settled = logs.filter(l => l.msg === 'settled')
      expect(settled).toEqual([expect.objectContaining({ ended: 'request' })])
      expect(settled[0]!.tokens).toBeGreaterThan(0)
      // Nothing decodes once it has stopped.
      const runs = await batchRuns(d)
      await new Promise(resolve => setTimeout(resolve, 200))
      expect(await batchRuns(d)).toBe(runs)
    } finally {
      await d.stop()
    }
  })

  it('stops when the daemon stops, and the stop does not wait for its tokens', async () => {
    const logs: Line[] = []
    const d = await startDaemon(ckpt.shardDir, join(ckpt.root, 'stopped'), endless, pino({ level: 'info' }, logTo(logs)))
    await decoding(d)
    await d.stop()
    expect(logs.filter(l => l.msg === 'settled')).toEqual([expect.objectContaining({ ended: 'stopping' })])
  })
})

/** The tiny model's batched runs so far (shoal_batch_size's count on /metrics). */
async function batchRuns (d: RunningDaemon): Promise<number> {
  const metrics = await (await fetch(`${d.url}/metrics`)).text()
  const line = metrics.split('\n').find(l => l.startsWith('shoal_batch_size_count{'))
  return line === undefined ? 0 : Number(line.split(' ').at(-1))
}

/** Until the daemon's engine runs steps nobody asked for: its settle. */
async function decoding (d: RunningDaemon): Promise<void> {
  const before = await batchRuns(d)
  await until(async () => await batchRuns(d) > before + 16)
}

async function until (ok: () => boolean | Promise<boolean>, boundMs = 30_000): Promise<void> {
  const began = Date.now()
  while (!(await ok())) {
    if (Date.now() - began > boundMs) throw new Error(`not within ${boundMs} ms`)
    await new Promise(resolve => setTimeout(resolve, 20))
  }
}
