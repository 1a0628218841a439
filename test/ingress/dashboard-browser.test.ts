/**
 * The dashboard page in a real headless Chromium on a node that requires client keys (a real
 * ingress on 127.0.0.1 with the real key check; the state is the real dashboardState of a
 * single-machine node): the page loads without a key, asks for one instead of showing data, says
 * so when the key is refused, and with a valid key shows the state and stays live over the event
 * stream (read with fetch(), which sends the key as a header). The key stays in sessionStorage and
 * never reaches the URL. Skips, saying why, without Chromium or playwright-core
 * (test/support/browser.ts). The page against a real 3-node mesh: test/mesh-e2e/dashboard-browser.test.ts.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createClientKey, encodeClientKey } from '../../certs/index.ts'
import { createIngress } from '../../daemon/ingress/index.ts'
import type { Ingress } from '../../daemon/ingress/index.ts'
import { createClientAuth } from '../../daemon/node/client-auth.ts'
import { dashboardState } from '../../daemon/node/dashboard-view.ts'
import { browserMissing, launchBrowser, pageWait } from '../support/browser.ts'
import type { PwBrowser, PwPage } from '../support/browser.ts'
import { createSimulatedService } from '../support/simulated-service.ts'
import { DAY, makeCa } from '../certs/fixtures.ts'

if (browserMissing !== undefined) console.warn(`dashboard browser test skipped: ${browserMissing}`)

const NOW = Date.now()
const ca = makeCa()
const validKey = encodeClientKey(createClientKey(ca.secretKey, ca.certificate, { name: 'ops', notBefore: new Date(NOW - DAY), notAfter: new Date(NOW + DAY) }))

let ingress: Ingress
let url: string
let browser: PwBrowser | undefined
let page: PwPage
/** Dashboard data the source handed out (only ever to a request with a valid key). */
let served = 0

describe.skipIf(browserMissing !== undefined)('the dashboard in headless Chromium, keys required', () => {
  beforeAll(async () => {
    ingress = createIngress({ logger: false }, {
      service: createSimulatedService({ models: [{ id: 'sim' }] }),
      auth: createClientAuth({ caCertificate: ca.certificate, revocations: () => undefined }),
      dashboard: {
        async state () {
          served++
          return dashboardState({
            now: Date.now(),
            self: { peerId: '12D3KooWKeyedDashboardTestNode', name: 'keyed-node', engine: 'cpu', device: 'cpu' },
            models: [{ id: 'sim' }],
            engines: [],
            stages: [],
            chainRequests: 0,
            receipts: [],
            receiptCount: 0,
            experts: {
              plans: [{
                model: 'sim-moe', key: 'a'.repeat(64),
                layers: [{ layer: 1, holders: { '12D3KooWHolderOne': [0, 1, 2], '12D3KooWHolderTwo': [1, 2, 3] } }, { layer: 2, holders: { '12D3KooWHolderOne': [0, 1, 2, 3] } }],
                nodes: [{ peerId: '12D3KooWHolderOne' }, { peerId: '12D3KooWHolderTwo' }], excluded: [], steps: 3, bytesOut: 1048576, bytesIn: 524288,
              }],
            },
          })
        },
        async verify () { return undefined },
      },
    })
    url = (await ingress.start()).url
    browser = await launchBrowser()
    page = await browser.newPage()
  }, 120_000)

  afterAll(async () => {
    await browser?.close().catch(() => {})
    await ingress?.stop()
  })

  it('asks for a key instead of showing data', async () => {
    await page.goto(`${url}/`)
    await pageWait(page, 'the key field', "!document.querySelector('#key-form').hidden")
    expect(await page.evaluate<string>("document.querySelector('#status').textContent")).toBe('key needed')
    expect(await page.evaluate<string>("document.querySelector('#self').textContent")).toBe('connecting…')
    expect(served).toBe(0)
  })

  it('says so when the key is refused, and asks again', async () => {
    await page.fill('#key', 'not-a-key')
    await page.click('#key-form button')
    await pageWait(page, 'the refusal', "document.querySelector('#key-error').textContent.includes('Incorrect API key')")
    expect(await page.evaluate<boolean>("document.querySelector('#key-form').hidden")).toBe(false)
    expect(await page.evaluate<string | null>("sessionStorage.getItem('shoal.dashboard.key')")).toBeNull()
    expect(served).toBe(0)
  })

  it('with a valid key shows the state and stays live; the key is in sessionStorage, not the URL', async () => {
    await page.fill('#key', validKey)
    await page.click('#key-form button')
    await pageWait(page, 'the live state', "document.querySelector('#status').classList.contains('live')")
    expect(await page.evaluate<boolean>("document.querySelector('#key-form').hidden")).toBe(true)
    expect(await page.evaluate<string>("document.querySelector('#self').textContent")).toContain('keyed-node')
    expect(await page.evaluate<string>("document.querySelector('#models').innerText")).toContain('sim')
    // The MoE expert plan: a row per holder with its expert count per layer, and the fewest copies.
    expect(await page.evaluate<boolean>("document.querySelector('#experts-section').hidden")).toBe(false)
    const rows = await page.evaluate<string[][]>("[...document.querySelectorAll('[data-experts=\"sim-moe\"] tr')].map(tr => [...tr.children].map(c => c.textContent))")
    expect(rows[0]).toEqual(['holder', 'L1', 'L2', 'total'])
    expect(rows.slice(1).map(r => r.slice(1))).toEqual([['3', '4', '7'], ['3', '0', '3'], ['1', '1', '']])
    expect(await page.evaluate<string>("document.querySelector('#experts').innerText")).toContain('2 holders')
    // Live over the stream: pushes keep arriving (the state is pushed at least every second).
    const first = Number(await page.evaluate<string>('document.body.dataset.updatedAt'))
    await pageWait(page, 'a later push', `Number(document.body.dataset.updatedAt) > ${first}`)
    expect(await page.evaluate<string | null>("sessionStorage.getItem('shoal.dashboard.key')")).toBe(validKey)
    expect(await page.evaluate<string>('location.href')).toBe(`${url}/`)
    // A reload in the same tab keeps the key: no second prompt.
    await page.goto(`${url}/`)
    await pageWait(page, 'the live state after a reload', "document.querySelector('#status').classList.contains('live')")
    expect(await page.evaluate<boolean>("document.querySelector('#key-form').hidden")).toBe(true)
  })
})
