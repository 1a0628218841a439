/**
 * Prompt lookup on by default on a chain's stage 0, through full daemons, beside the chain's KV
 * prefix reuse (wave 39): A holds stage 0 of an fp32 model and coordinates without `--draft`, B
 * holds stage 1; both keep prefixes. Until wave 39 a chain coordinator got no default lookup,
 * because a source wrapper turned its chains' prefix reuse off; now a speculating request prefills
 * through the chain from a kept prefix like any other, and keeps its prompt for the next one.
 * Greedy tokens equal a local chain's decoding plainly (`--draft none`), the receipt names the
 * default drafter and counts drafts verified, and a repeated prompt opens every stage from the
 * kept prefix.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { DEFAULT_LOOKUP_NAME } from '../../daemon/speculative/index.ts'
import { waitFor } from './harness.ts'
import { complete, speculationOf, startChainPair } from './chain-pair.ts'
import type { ChainNode, ChainPair } from './chain-pair.ts'

const MODEL_ID = 'chain-fp32'
// Token ids that repeat, so prompt lookup has drafts to verify.
const PROMPT = Array.from({ length: 48 }, (_, i) => 3 + (i % 6) * 41)

describe('default prompt lookup on a chain coordinator, with prefix reuse, through daemons', () => {
  let pair: ChainPair

  beforeAll(async () => {
    pair = await startChainPair({ name: 'chain-default', modelId: MODEL_ID, size: 'tiny', seed: 9, b: { kvCacheMb: 16 }, a: { kvCacheMb: 16 } })
    const { a, b } = pair
    await waitFor('A to see B holding stage 1', () => a.daemon.mesh!.peers().some(p => p.peerId === b.peerId && p.state === 'alive' &&
      p.capabilities?.models.some(m => m.id === MODEL_ID) === true), 30_000)
  }, 300_000)

  afterAll(async () => {
    await pair?.stop()
  })

  it('drafts over the chain A → B with the local chain\'s tokens, and a repeated prompt reuses the kept prefix', async () => {
    const { a, b, localUrl } = pair
    const want = (await complete(localUrl, MODEL_ID, PROMPT, 48)).tokenIds
    const first = await complete(a.url!, MODEL_ID, PROMPT, 48)
    expect(first.route.split(',')).toEqual([a.peerId, b.peerId])
    expect(first.tokenIds).toEqual(want)
    expect(first.reused).toBeUndefined()
    const spec = await speculationOf(a.url!, first.receiptId)
    expect(spec?.drafter).toBe(DEFAULT_LOOKUP_NAME)
    expect(spec!.drafted).toBeGreaterThan(0)
    // A's capabilities declare the default drafter for the model requests enter by; B's stage none.
    const declared = (n: ChainNode, of: ChainNode): string | undefined => n.daemon.mesh!.peers().find(p => p.peerId === of.peerId)?.capabilities?.models.find(m => m.id === MODEL_ID)?.drafter
    await waitFor('B to see A declare the default drafter', () => declared(b, a) === DEFAULT_LOOKUP_NAME, 30_000)
    expect(declared(a, b)).toBeUndefined()

    // The same prompt again opens every stage from the kept prefix. An open waits at most 300 ms
    // for the stages to acknowledge their keeps (keep-acks.ts) and otherwise prefills whole, and
    // keeps again: on a loaded machine a later repeat is the one that reuses.
    let again = await complete(a.url!, MODEL_ID, PROMPT, 48)
    for (let tries = 1; again.reused === undefined && tries < 5; tries++) {
      expect(again.tokenIds).toEqual(want)
      again = await complete(a.url!, MODEL_ID, PROMPT, 48)
    }
    expect(again.tokenIds).toEqual(want)
    expect(again.reused).toBeGreaterThan(0)
    expect((await speculationOf(a.url!, again.receiptId))?.drafter).toBe(DEFAULT_LOOKUP_NAME)
  }, 120_000)
})
