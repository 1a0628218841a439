/**
 * The last node that could take a request queues it instead of refusing it for its latency budget
 * (GenerateRequest.soleServer, set by routing): a node refuses work it cannot start within its
 * budget so that routing can place it on another node, and a lone `shoal node` has no other node.
 * Real daemons on loopback, the tiny model, a budget of 1 ms (so that every request beyond the free
 * sequences would be refused by it), the openai client without retries (a 429 is a failure here):
 * - a node alone in its mesh takes a burst of twice its sequences from its own ingress;
 * - a model-less ingress forwards the same burst to the one node serving the model, which queues it;
 * - the control: a daemon without a mesh (no routing, so no soleServer) at the same budget refuses
 *   part of the same burst — the budget is what would have refused it.
 */
import { join } from 'node:path'
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import type OpenAI from 'openai'
import { RateLimitError } from 'openai'
import { createThrowawayCa } from '../../certs/index.ts'
import { DEFAULT_MAX_SEQUENCES } from '../../daemon/engine/index.ts'
import { MODEL_ID, makeTinyCheckpoint, startDaemon } from '../e2e/daemon.ts'
import type { TinyCheckpoint } from '../e2e/daemon.ts'
import { clientFor, sees, startInProcess, waitFor } from './harness.ts'
import type { MeshNode } from './harness.ts'

const PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
const BUDGETS = { batchBudgetMs: 1 }
const BURST = 2 * DEFAULT_MAX_SEQUENCES

let ck: TinyCheckpoint
let server: MeshNode
let ingressIdentity: string
const stops: Array<() => Promise<void>> = []

/** A burst of BURST concurrent 48-token completions: how many finished and how many were refused (429). */
async function burst (client: OpenAI): Promise<{ done: number, refused: number, texts: Set<string> }> {
  const outcomes = await Promise.all(Array.from({ length: BURST }, async () =>
    await client.completions.create({ model: MODEL_ID, prompt: PROMPT, max_tokens: 48, temperature: 0 }).then(r => r, (err: unknown) => {
      if (err instanceof RateLimitError) return 'refused' as const
      throw err
    })))
  const done = outcomes.flatMap(o => o === 'refused' ? [] : [o])
  for (const r of done) expect(r.usage?.completion_tokens).toBe(48)
  return { done: done.length, refused: outcomes.length - done.length, texts: new Set(done.map(r => r.choices[0]?.text ?? '')) }
}

/** One request first, so that the engine has measured its step time (unmeasured, it queues anything). */
async function warm (client: OpenAI): Promise<void> {
  await client.completions.create({ model: MODEL_ID, prompt: PROMPT, max_tokens: 16, temperature: 0 })
}

describe('the last node that could take a request queues it (soleServer)', () => {
  beforeAll(async () => {
    ck = await makeTinyCheckpoint({ compile: true })
    const ca = await createThrowawayCa(join(ck.root, 'pki'), ['server', 'ingress'])
    ingressIdentity = ca.identities[1]!.dir
    server = await startInProcess({ name: 'server', identityDir: ca.identities[0]!.dir, root: ck.root, model: ck.shardDir, api: true, bootstrap: [], budgets: BUDGETS })
    stops.push(async () => { await server.stop() })
  })
  afterAll(async () => {
    for (const stop of stops.reverse()) await stop().catch(() => {})
    await ck?.cleanup()
  })

  it('a node alone in its mesh queues a burst of twice its sequences from its own ingress', async () => {
    const client = clientFor(server.url!)
    await warm(client)
    const r = await burst(client)
    expect(r).toMatchObject({ done: BURST, refused: 0 })
    expect(r.texts.size).toBe(1)
  })

  it('a model-less ingress forwards the burst to the only node serving the model, which queues it', async () => {
    const ingress = await startInProcess({ name: 'ingress', identityDir: ingressIdentity, root: ck.root, api: true, bootstrap: server.addrs, budgets: BUDGETS })
    stops.push(async () => { await ingress.stop() })
    await waitFor('the ingress to see the server', async () => await sees(ingress.url!, [server.peerId], MODEL_ID))
    const r = await burst(clientFor(ingress.url!))
    expect(r).toMatchObject({ done: BURST, refused: 0 })
    expect(r.texts.size).toBe(1)
  })

  it('control: without routing (no mesh, so never the last node by routing\'s word) the same budget refuses part of the burst', async () => {
    const root = await mkdtemp(join(tmpdir(), 'shoal-sole-control-'))
    const alone = await startDaemon(ck.shardDir, root, { budgets: BUDGETS })
    try {
      await warm(alone.client)
      const r = await burst(alone.client)
      expect(r.refused).toBeGreaterThan(0)
      expect(r.done + r.refused).toBe(BURST)
    } finally {
      await alone.stop()
      await rm(root, { recursive: true, force: true })
    }
  })
})
