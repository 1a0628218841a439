/**
 * Issue 5 under failure, with real processes: three replicas run as CHILD PROCESSES of the real
 * CLI (`node scripts/shoal.mjs node --identity … --model … --listen … --bootstrap … --data …`,
 * identities from a throwaway CA, SHOAL_CACHE in a temp dir) behind an in-process ingress node
 * that has an API and no model. Replicas are SIGKILLed — nothing closes cleanly — and:
 *   - during a burst, every request either completes exactly (token for token) or ends in a clean
 *     OpenAI-shaped error; never a hang past its deadline, never an empty 200;
 *   - the dead node leaves /v1/mesh within the liveness bound and new requests all succeed on
 *     the survivors;
 *   - a replica killed while idle (still listed alive) costs nothing but time: requests sent to it
 *     are retried, invisibly, on a survivor;
 *   - when the model's only replica is dead: 503 with a reason while the mesh still knows the
 *     model; once the replica is dropped, the model leaves /v1/models and requests get 404.
 */
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { APIConnectionTimeoutError, APIError } from 'openai'
import type OpenAI from 'openai'
import type { CompletionCreateParams } from 'openai/resources/completions'
import { createThrowawayCa } from '../../certs/index.ts'
import { DEFAULT_TIMINGS } from '../../daemon/mesh/index.ts'
import { MODEL_ID, makeTinyCheckpoint, startDaemon } from '../e2e/daemon.ts'
import type { RunningDaemon, TinyCheckpoint } from '../e2e/daemon.ts'
import { clientFor, meshOf, sees, spawnNode, startInProcess, waitFor } from './harness.ts'
import type { ChildNode, MeshNode } from './harness.ts'

/** Token ids of a prompt inside the tiny model's vocabulary (no tokenizer needed). */
const PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 32, 84, 104, 101]
const TOKENS = 192
/** The deadline a client gives every request: a hang shows up as a client timeout. */
const CLIENT_DEADLINE_MS = 60_000
/** The daemon's liveness bounds (default mesh timings) plus slack for the sweep, a poll and a loaded CI machine. */
const SLACK_MS = 5_000
const SUSPECT_BOUND_MS = DEFAULT_TIMINGS.suspectAfterMs + SLACK_MS
const GONE_BOUND_MS = DEFAULT_TIMINGS.goneAfterMs + SLACK_MS

type Outcome =
  | { kind: 'ok', route: string | null, tokenIds: number[], finish: string }
  | { kind: 'error', route: string | null, status: number | undefined, code: string | null | undefined, type: string | undefined, message: string, tokensBefore: number }
  | { kind: 'empty', route: string | null, tokensBefore: number }
  | { kind: 'hang', route: string | null }

interface TokenChoice { text: string, finish_reason: string | null, token_ids?: number[] }

let ck: TinyCheckpoint
let serve: RunningDaemon
let ingress: MeshNode
const children: ChildNode[] = []
let api: OpenAI
let expected: number[]

const params = (maxTokens = TOKENS): CompletionCreateParams & { return_token_ids: boolean } =>
  ({ model: MODEL_ID, prompt: PROMPT, max_tokens: maxTokens, temperature: 0, return_token_ids: true })

function failed (err: unknown, route: string | null, tokensBefore: number): Outcome {
  if (err instanceof APIConnectionTimeoutError) return { kind: 'hang', route }
  if (err instanceof APIError) {
    // Mid-stream the error arrives as an SSE event inside a 200 (no HTTP status): OpenAI's shape.
    const e = err.error as { type?: string } | undefined
    return { kind: 'error', route, status: err.status, code: err.code, type: e?.type, message: err.message, tokensBefore }
  }
  throw err
}

/** A non-streaming completion; its route is only known when it answers. */
async function whole (client: OpenAI, maxTokens = TOKENS): Promise<Outcome> {
  try {
    const { data, response } = await client.completions.create({ ...params(maxTokens), stream: false } as CompletionCreateParams & { stream: false }).withResponse()
    const c = data.choices[0] as unknown as TokenChoice | undefined
    const route = response.headers.get('x-shoal-route')
    if (c === undefined || c.finish_reason == null) return { kind: 'empty', route, tokensBefore: 0 }
    return { kind: 'ok', route, tokenIds: c.token_ids ?? [], finish: c.finish_reason }
  } catch (err) {
    return failed(err, null, 0)
  }
}

/** A streaming completion; `started` resolves with its route once the first token arrives. */
function streamed (client: OpenAI): { started: Promise<string | null>, outcome: Promise<Outcome> } {
  let markStarted!: (route: string | null) => void
  const started = new Promise<string | null>(resolve => { markStarted = resolve })
  const outcome = (async (): Promise<Outcome> => {
    let route: string | null = null
    const ids: number[] = []
    try {
      const { data: stream, response } = await client.completions.create({ ...params(), stream: true } as CompletionCreateParams & { stream: true }).withResponse()
      route = response.headers.get('x-shoal-route')
      let finish: string | null = null
      for await (const chunk of stream) {
        const c = chunk.choices[0] as unknown as TokenChoice | undefined
        if (c === undefined) continue
        ids.push(...(c.token_ids ?? []))
        if (ids.length > 0) markStarted(route)
        if (c.finish_reason != null) finish = c.finish_reason
      }
      // A stream that ends without a finish reason and without an error is an "empty 200".
      return finish === null ? { kind: 'empty', route, tokensBefore: ids.length } : { kind: 'ok', route, tokenIds: ids, finish }
    } catch (err) {
      return failed(err, route, ids.length)
    } finally {
      markStarted(route)
    }
  })()
  return { started, outcome }
}

/** What a dead replica may cost a request: a clean error in OpenAI's shape with a server status. */
function expectCleanError (o: Extract<Outcome, { kind: 'error' }>): void {
  // An HTTP error before any token, or an error event after some (then the status was a 200).
  if (o.tokensBefore === 0 && o.status !== undefined) expect(o.status, o.message).toBeGreaterThanOrEqual(500)
  else expect(o.status, o.message).toBeUndefined()
  expect(o.code).toMatch(/^SHOAL_ERR_/)
  expect(o.type).toBe('server_error')
  expect(o.message.length).toBeGreaterThan(0)
}

const replicaIds = (): string[] => children.filter(c => c.child.exitCode === null && c.child.signalCode === null).map(c => c.peerId)

async function listedAlive (peerId: string): Promise<boolean> {
  return (await meshOf(ingress.url!)).peers.some(p => p.peerId === peerId && p.state === 'alive')
}
async function listed (peerId: string): Promise<boolean> {
  return (await meshOf(ingress.url!)).peers.some(p => p.peerId === peerId)
}

beforeAll(async () => {
  ck = await makeTinyCheckpoint({ compile: true })
  serve = await startDaemon(ck.shardDir, join(ck.root, 'serve'))
  const ref = await whole(serve.client)
  if (ref.kind !== 'ok') throw new Error(`the reference completion failed: ${JSON.stringify(ref)}`)
  expected = ref.tokenIds

  const ca = await createThrowawayCa(join(ck.root, 'pki'), ['ingress', 'replica-1', 'replica-2', 'replica-3'])
  const [a, ...rs] = ca.identities
  ingress = await startInProcess({ name: 'ingress', identityDir: a!.dir, root: ck.root, api: true, bootstrap: [] })
  api = clientFor(ingress.url!, CLIENT_DEADLINE_MS)
  const cacheDir = join(ck.root, 'shoal-cache')
  const started = await Promise.all(rs.map(async (id, i) => await spawnNode({
    name: `replica-${i + 1}`, identityDir: id.dir, dataDir: join(ck.root, `data-replica-${i + 1}`), cacheDir, model: ck.shardDir, bootstrap: ingress.addrs,
  })))
  children.push(...started)
  await waitFor('the ingress to see all three replicas alive with the model', async () => await sees(ingress.url!, replicaIds(), MODEL_ID), 60_000)
}, 180_000)

afterAll(async () => {
  for (const c of children) c.kill('SIGKILL')
  await Promise.all(children.map(async c => { await c.exited }))
  await ingress?.stop().catch(() => {})
  await serve?.stop().catch(() => {})
  await ck?.cleanup()
})

describe('replicas killed with SIGKILL', () => {
  it('the reference is a whole greedy completion', () => {
    expect(expected).toHaveLength(TOKENS)
  })

  it('a replica killed during a burst: every request completes exactly or fails cleanly; none hangs, none is an empty 200', async () => {
    const streams = Array.from({ length: 9 }, () => streamed(api))
    const wholes = Array.from({ length: 3 }, async () => await whole(api))
    const routes = await Promise.all(streams.map(async s => await s.started))
    // Kill the replica running the most streams, while they are mid-generation.
    const counts = new Map<string, number>()
    for (const r of routes) if (r !== null) counts.set(r, (counts.get(r) ?? 0) + 1)
    const victimId = [...counts].sort((x, y) => y[1] - x[1])[0]![0]
    const victim = children.find(c => c.peerId === victimId)!
    expect(victim, `route ${victimId} is one of the child replicas`).toBeDefined()
    victim.kill('SIGKILL')
    await victim.exited
    const killedAt = Date.now()

    const settledAt: number[] = []
    const outcomes = [
      ...await Promise.all(streams.map(async s => { const o = await s.outcome; settledAt.push(Date.now() - killedAt); return o })),
      ...await Promise.all(wholes.map(async w => { const o = await w; settledAt.push(Date.now() - killedAt); return o })),
    ]
    const summary = outcomes.map(o => o.kind === 'error' ? `${o.kind}:${o.status}:${o.code}:${o.tokensBefore}` : o.kind)
    for (const o of outcomes) {
      expect(o.kind, `no request may hang or end empty: ${summary.join(', ')}; settled ms after the kill: ${settledAt.join(' ')}`).not.toMatch(/^(hang|empty)$/)
      if (o.kind === 'ok') {
        expect(o.tokenIds).toEqual(expected)
        expect(o.finish).toBe('length')
        expect(o.route).not.toBe(ingress.peerId)
      } else if (o.kind === 'error') {
        expectCleanError(o)
        // Only the dead replica's requests may fail (non-streaming ones do not know their route).
        if (o.route !== null) expect(o.route).toBe(victimId)
      }
    }
    // Streams on the survivors were not disturbed.
    for (const [i, o] of outcomes.slice(0, streams.length).entries()) {
      if (routes[i] !== victimId) expect(o.kind, `stream ${i} on survivor ${routes[i]}`).toBe('ok')
    }
    // At least the streams that had started on the victim saw its death.
    expect(outcomes.filter(o => o.kind === 'error').length).toBeGreaterThan(0)

    // The dead node stops being alive, then leaves the table, within the liveness bounds.
    await waitFor('the victim to be no longer alive in /v1/mesh', async () => !await listedAlive(victimId), Math.max(0, killedAt + SUSPECT_BOUND_MS - Date.now()))
    await waitFor('the victim to leave /v1/mesh', async () => !await listed(victimId), Math.max(0, killedAt + GONE_BOUND_MS - Date.now()))
    const models = await api.models.list()
    expect((models.data[0] as unknown as { served_by: string[] }).served_by.sort()).toEqual(replicaIds().sort())

    // New requests all succeed, on the survivors only.
    const after = await Promise.all(Array.from({ length: 6 }, async () => await whole(api, 64)))
    for (const o of after) {
      expect(o.kind, JSON.stringify(o).slice(0, 300)).toBe('ok')
      if (o.kind !== 'ok') continue
      expect(o.tokenIds).toEqual(expected.slice(0, 64))
      expect(replicaIds()).toContain(o.route)
    }
  }, 120_000)

  it('a replica killed while idle and still listed alive: requests sent to it are retried on a survivor, invisibly', async () => {
    expect(replicaIds()).toHaveLength(2)
    await waitFor('both survivors to report idle load', async () =>
      (await meshOf(ingress.url!)).peers.filter(p => replicaIds().includes(p.peerId) && p.state === 'alive' && p.load?.inFlight === 0).length === 2)
    const [victim, survivor] = children.filter(c => replicaIds().includes(c.peerId))
    victim!.kill('SIGKILL')
    await victim!.exited
    expect(await listedAlive(victim!.peerId)).toBe(true)
    // Sent at once, while the table still lists the dead node alive: some are routed to it.
    const outcomes = await Promise.all(Array.from({ length: 6 }, async () => await whole(api, 64)))
    for (const o of outcomes) {
      expect(o.kind, JSON.stringify(o).slice(0, 300)).toBe('ok')
      if (o.kind !== 'ok') continue
      expect(o.tokenIds).toEqual(expected.slice(0, 64))
      expect(o.route).toBe(survivor!.peerId)
    }
    await waitFor('the idle victim to leave /v1/mesh', async () => !await listed(victim!.peerId), GONE_BOUND_MS)
  }, 120_000)

  it('the only replica dead: 503 with a reason while the mesh still knows the model, then 404 once it is dropped', async () => {
    expect(replicaIds()).toHaveLength(1)
    const last = children.find(c => replicaIds().includes(c.peerId))!
    await waitFor('the last replica to report its load', async () => await sees(ingress.url!, [last.peerId], MODEL_ID))
    last.kill('SIGKILL')
    await last.exited
    const killedAt = Date.now()
    // Sent while the table still lists the dead node alive: it waits on the dead connection (a
    // SIGKILLed QUIC peer sends no close) until the mesh stops hearing from the node (suspect),
    // then fails cleanly — while the node is still listed, long before it is dropped.
    const first = (async () => { const o = await whole(api, 8); return { o, at: Date.now(), stillListed: await listed(last.peerId) } })()
    // Sent once the node is suspect (silent, not yet dropped): refused at once, with the reason.
    await waitFor('the dead replica to turn suspect', async () => await listed(last.peerId) && !await listedAlive(last.peerId), SUSPECT_BOUND_MS)
    const during = await whole(api, 8)
    expect(during).toMatchObject({ kind: 'error', status: 503, type: 'server_error', code: 'SHOAL_ERR_NO_ELIGIBLE_NODE' })
    expect((during as { message: string }).message).toMatch(/1 unreachable/)
    const { o, at, stillListed } = await first
    expect(o, JSON.stringify(o)).toMatchObject({ kind: 'error', status: 503, type: 'server_error' })
    expect(['SHOAL_ERR_PEER_UNAVAILABLE', 'SHOAL_ERR_NO_ELIGIBLE_NODE']).toContain((o as { code: string }).code)
    expect(at - killedAt, 'the first request waited past the liveness bound').toBeLessThan(GONE_BOUND_MS)
    expect(stillListed, `the first request ended only once the dead node was dropped (${at - killedAt} ms after the kill)`).toBe(true)
    // Dropped: the mesh no longer offers the model, and a request for it is a 404.
    await waitFor('the dead replica to leave /v1/mesh', async () => !await listed(last.peerId), Math.max(0, killedAt + GONE_BOUND_MS - Date.now()))
    expect((await api.models.list()).data).toEqual([])
    const gone = await whole(api, 8)
    expect(gone).toMatchObject({ kind: 'error', status: 404, code: 'SHOAL_ERR_MODEL_NOT_FOUND' })
  }, 120_000)
})
