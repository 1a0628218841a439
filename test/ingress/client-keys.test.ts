/**
 * `--require-keys` at the ingress, through the real openai client over a real socket: its `apiKey`
 * carries a `shoal ca key` token unchanged; a missing, forged, foreign, expired or revoked key is a
 * 401 in OpenAI's error shape on every /v1/* route (health and metrics stay open); the receipt in
 * the real ledger records the key's name and serial.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { randomBytes } from 'node:crypto'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import OpenAI, { AuthenticationError } from 'openai'
import { peerIdFromPrivateKey } from '@libp2p/peer-id'
import { privateKeyFromRaw } from '@libp2p/crypto/keys'
import { createClientKey, encodeClientKey, publicKeyOf } from '../../certs/index.ts'
import type { RevocationList } from '../../certs/index.ts'
import { createIngress } from '../../daemon/ingress/index.ts'
import type { Ingress } from '../../daemon/ingress/index.ts'
import { createLedger } from '../../daemon/ledger/index.ts'
import type { Ledger } from '../../daemon/ledger/index.ts'
import { withReceipts } from '../../daemon/node/index.ts'
import { createClientAuth } from '../../daemon/node/client-auth.ts'
import { createSimulatedService } from '../support/simulated-service.ts'
import { DAY, makeCa, makeRevocations } from '../certs/fixtures.ts'
import { expectOpenAIError } from './harness.ts'

const NOW = Date.now()
const ca = makeCa()
const key = (name: string, from = NOW - DAY, until = NOW + DAY, issuer = ca) =>
  createClientKey(issuer.secretKey, issuer.certificate, { name, notBefore: new Date(from), notAfter: new Date(until) })

let dir: string
let ledger: Ledger
let ingress: Ingress
let url: string
let revocations: RevocationList | undefined

beforeAll(async () => {
  dir = await mkdtemp(join(tmpdir(), 'shoal-client-keys-'))
  const seed = new Uint8Array(randomBytes(32))
  const nodeKey = privateKeyFromRaw(new Uint8Array([...seed, ...publicKeyOf(seed)]))
  ledger = createLedger({ dataDir: dir, signer: { peerId: peerIdFromPrivateKey(nodeKey).toString(), secretKey: seed } })
  await ledger.start()
  const service = withReceipts(createSimulatedService({ models: [{ id: 'sim' }] }), ledger)
  ingress = createIngress({ logger: false }, {
    service,
    receipts: { get: async (id) => (await ledger.get(id))?.receipt },
    auth: createClientAuth({ caCertificate: ca.certificate, revocations: () => revocations }),
  })
  url = (await ingress.start()).url
})
afterAll(async () => {
  await ingress?.stop()
  await ledger?.stop()
  await rm(dir, { recursive: true, force: true })
})

const client = (apiKey: string): OpenAI => new OpenAI({ baseURL: `${url}/v1`, apiKey, maxRetries: 0 })

describe('client keys at the ingress', () => {
  it('serves a valid key through the openai client and records its name in the receipt', async () => {
    const alice = key('alice')
    const { data, response } = await client(encodeClientKey(alice)).chat.completions.create({ model: 'sim', messages: [{ role: 'user', content: 'hi' }] }).withResponse()
    expect(data.choices[0]?.message.content).toBeTypeOf('string')
    const receiptId = response.headers.get('x-shoal-receipt')!
    const stored = await ledger.get(receiptId)
    expect(stored?.receipt.body.client).toEqual({ name: 'alice', serial: alice.body.serial })
    // The receipt route is behind the key too, and answers to it.
    const res = await fetch(`${url}/v1/receipts/${receiptId}`, { headers: { authorization: `Bearer ${encodeClientKey(alice)}` } })
    expect(res.status).toBe(200)
    expect(((await res.json()) as { body: { client: unknown } }).body.client).toEqual({ name: 'alice', serial: alice.body.serial })
    // Streaming too.
    const stream = await client(encodeClientKey(alice)).completions.create({ model: 'sim', prompt: 'hi', stream: true })
    let chunks = 0
    for await (const _ of stream) chunks++
    expect(chunks).toBeGreaterThan(0)
  })

  it('refuses every bad key with 401 in OpenAI shape, before the service sees the request', async () => {
    const alice = key('alice-2')
    const forged = { body: { ...alice.body, name: 'admin' }, signature: alice.signature }
    const cases: Array<[string, string]> = [
      ['unused', 'malformed'],
      [encodeClientKey(forged as never), 'bad-signature'],
      [encodeClientKey(key('eve', NOW - DAY, NOW + DAY, makeCa('rogue-ca'))), 'wrong-ca'],
      [encodeClientKey(key('old', NOW - 3 * DAY, NOW - 2 * DAY)), 'expired'],
    ]
    const before = ledger.size
    for (const [apiKey, reason] of cases) {
      const err = await client(apiKey).chat.completions.create({ model: 'sim', messages: [{ role: 'user', content: 'hi' }] }).catch((e: unknown) => e)
      expect(err, reason).toBeInstanceOf(AuthenticationError)
      const e = err as AuthenticationError
      expect(e.status).toBe(401)
      expect(e.error).toMatchObject({ type: 'invalid_request_error', code: 'SHOAL_ERR_INVALID_API_KEY', param: null })
      expect((e.error as { message: string }).message).toContain(reason)
    }
    for (const [path, init] of [
      ['/v1/models', {}],
      ['/v1/completions', { method: 'POST', headers: { 'content-type': 'application/json' }, body: '{"model":"sim","prompt":"x"}' }],
      ['/v1/mesh', {}],
      ['/v1/receipts/abc', { headers: { authorization: 'Basic dXNlcjpwYXNz' } }],
      ['/v1/nope', { headers: { authorization: 'Bearer' } }],
    ] as Array<[string, RequestInit]>) {
      const res = await fetch(`${url}${path}`, init)
      expect(res.status, path).toBe(401)
      expect(res.headers.get('www-authenticate')).toMatch(/^Bearer/)
      expect(expectOpenAIError(await res.json()).code).toBe('SHOAL_ERR_INVALID_API_KEY')
    }
    expect(ledger.size).toBe(before)
    for (const path of ['/healthz', '/metrics']) expect((await fetch(`${url}${path}`)).status, path).toBe(200)
  })

  it('refuses a key once the newest revocation list names it, without a restart', async () => {
    const bob = key('bob')
    const c = client(encodeClientKey(bob))
    await c.models.list()
    revocations = makeRevocations(ca, 1, [bob.body.serial])
    const err = await c.models.list().catch((e: unknown) => e)
    expect(err).toBeInstanceOf(AuthenticationError)
    expect(((err as AuthenticationError).error as { message: string }).message).toMatch(/revoked/)
    // Other keys keep working.
    expect((await client(encodeClientKey(key('carol'))).models.list()).data.length).toBeGreaterThan(0)
    revocations = undefined
  })
})
