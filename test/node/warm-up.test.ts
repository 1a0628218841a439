/**
 * The start-up warm-up (daemon/node/warm-up.ts): a real daemon on the tiny model warms up before
 * it listens, and leaves no receipt, no request metric and no kept prefix behind; its answers are
 * token for token those of a daemon that did not warm up.
 */
import { join } from 'node:path'
import { Writable } from 'node:stream'
import { pino } from 'pino'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { WARM_UP, warmUpGoesOn, warmUpRequests } from '../../daemon/node/warm-up.ts'
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
  type Line = { msg?: string, completed?: number, failed?: number }
  const logs: Line[] = []
  const briefLogs: Line[] = []
  const logTo = (lines: Line[]): Writable => new Writable({ write (chunk: Buffer, _enc, done) { lines.push(JSON.parse(chunk.toString())); done() } })

  beforeAll(async () => {
    ckpt = await makeTinyCheckpoint({ compile: true })
    // WARM_UP's requests with bounds no loaded machine reaches: every request runs (the bounds
    // themselves are warmUpGoesOn's, above).
    warm = await startDaemon(ckpt.shardDir, join(ckpt.root, 'warm'), { warmUp: { ...WARM_UP, budgetMs: 60_000, slowStepMs: Infinity } }, pino({ level: 'info' }, logTo(logs)))
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
