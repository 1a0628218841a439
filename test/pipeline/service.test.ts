/**
 * The pipeline InferenceService on a coordinator: same events (token ids, text, finish, usage) as
 * the local service on the unsplit model, start.route = the chain's peers in order, and an
 * incomplete chain refused before start with the missing layers named.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createLocalService } from '../../daemon/engine/index.ts'
import type { LocalService } from '../../daemon/engine/index.ts'
import { createPipelineService } from '../../daemon/pipeline/index.ts'
import type { PipelineService } from '../../daemon/pipeline/index.ts'
import type { GenerateEvent, GenerateRequest } from '../../daemon/service.ts'
import { buildModels, chainRequest, eventually, holderOf, startStage, stopHost } from './fixture.ts'
import type { Models, StageHost } from './fixture.ts'

let models: Models
let local: LocalService
let hosts: StageHost[] = []
let service: PipelineService
let holders: () => ReturnType<typeof holderOf>[]

beforeAll(async () => {
  models = await buildModels()
  local = createLocalService({ shardDir: models.whole, threads: 1 })
  await local.start()
  hosts = [await startStage(models.three, [0, 1]), await startStage(models.three, [2, 2]), await startStage(models.three, [3, 3])]
  holders = () => hosts.slice(1).map(h => holderOf(h))
  service = createPipelineService({ stage: hosts[0]!.stage, shardDir: models.three }, { holders: () => holders() })
  await service.start()
}, 120_000)
afterAll(async () => {
  await service?.stop()
  for (const h of hosts) await stopHost(h)
  await local?.stop()
  await models?.cleanup()
})

const request = (id: string, over: Partial<GenerateRequest> = {}): GenerateRequest =>
  chainRequest(id, { kind: 'chat', messages: [{ role: 'user', content: 'Tell me about the sea.' }] }, 40, over)

async function collect (events: AsyncIterable<GenerateEvent>): Promise<GenerateEvent[]> {
  const out: GenerateEvent[] = []
  for await (const e of events) out.push(e)
  return out
}

describe('pipeline service', () => {
  it('streams the same tokens and text as the local service, with the chain as the route', async () => {
    const want = await collect(local.generate(request('local-1'), new AbortController().signal))
    const got = await collect(service.generate(request('chain-1'), new AbortController().signal))
    expect(got[0]).toMatchObject({ type: 'start', route: hosts.map(h => h.peerId), receiptId: 'chain-1' })
    expect(got.slice(1)).toEqual(want.slice(1))
    expect((want[0] as Extract<GenerateEvent, { type: 'start' }>).promptTokenIds).toEqual((got[0] as Extract<GenerateEvent, { type: 'start' }>).promptTokenIds)
    for (const h of hosts) expect(await eventually(() => h.stage.node.engine.stats(), s => s.liveSequences === 0)).toMatchObject({ liveSequences: 0 })
    expect(service.stats().activeRequests).toBe(0)
  }, 60_000)

  it('refuses before start when no complete chain exists, naming the missing layers', async () => {
    holders = () => [holderOf(hosts[1]!)]
    try {
      await expect(collect(service.generate(request('chain-2'), new AbortController().signal)))
        .rejects.toMatchObject({ code: 'SHOAL_ERR_CHAIN_INCOMPLETE', message: expect.stringContaining('layers 3') })
    } finally {
      holders = () => hosts.slice(1).map(h => holderOf(h))
    }
    expect((await hosts[0]!.stage.node.engine.stats()).liveSequences).toBe(0)
  }, 30_000)

  it('ends generation and frees every stage when the client goes away', async () => {
    const ctl = new AbortController()
    const seen: GenerateEvent[] = []
    const run = (async () => {
      for await (const e of service.generate(request('chain-3', { maxTokens: 500 }), ctl.signal)) {
        seen.push(e)
        if (seen.length === 4) ctl.abort()
      }
    })()
    await expect(run).rejects.toMatchObject({ code: 'SHOAL_ERR_ABORTED' })
    for (const h of hosts) {
      expect(await eventually(() => h.stage.node.engine.stats(), s => s.liveSequences === 0)).toMatchObject({ liveSequences: 0, kvBytes: 0 })
      expect(await eventually(() => h.stage.node.stats(), s => s.served === 0 && s.watched === 0)).toMatchObject({ served: 0, watched: 0 })
    }
  }, 30_000)

  it('with its one chain slot busy, refuses a request at once, and lets one routing sent here as the last node (soleServer) wait for the slot until its deadline', async () => {
    const one = createPipelineService({ stage: hosts[0]!.stage, shardDir: models.three, maxRequests: 1 }, { holders: () => holders() })
    await one.start()
    const hold = new AbortController()
    let holding: Promise<unknown> | undefined
    try {
      const want = await collect(local.generate(request('local-sole'), new AbortController().signal))
      // The slot is held once the first request has started.
      const first = one.generate(request('sole-hold', { maxTokens: 500 }), hold.signal)[Symbol.asyncIterator]()
      expect((await first.next()).value).toMatchObject({ type: 'start' })
      holding = (async () => { for (;;) if ((await first.next()).done === true) return })().catch(() => {})
      await expect(collect(one.generate(request('sole-refused'), new AbortController().signal)))
        .rejects.toMatchObject({ code: 'SHOAL_ERR_OVERLOADED', message: expect.stringContaining('chain slots') })
      // A sole server's request whose deadline passes while it waits ends with the deadline, not a refusal.
      await expect(collect(one.generate(request('sole-late', { soleServer: true, deadline: Date.now() + 300 }), new AbortController().signal)))
        .rejects.toMatchObject({ code: 'SHOAL_ERR_DEADLINE' })
      const waiting = collect(one.generate(request('sole-wait', { soleServer: true }), new AbortController().signal))
      // It waits for the slot (not refused, not started) until the first request lets go of it.
      expect(await eventually(() => one.stats(), s => s.waitingRequests === 1)).toMatchObject({ activeRequests: 1, waitingRequests: 1 })
      hold.abort()
      const got = await waiting
      expect(got[0]).toMatchObject({ type: 'start', receiptId: 'sole-wait' })
      expect(got.slice(1)).toEqual(want.slice(1))
      expect(one.stats()).toMatchObject({ activeRequests: 0, waitingRequests: 0 })
    } finally {
      hold.abort()
      await holding
      await one.stop()
    }
    for (const h of hosts) expect(await eventually(() => h.stage.node.engine.stats(), s => s.liveSequences === 0)).toMatchObject({ liveSequences: 0 })
  }, 60_000)
})
