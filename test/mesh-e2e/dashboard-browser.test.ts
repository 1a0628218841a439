/**
 * The dashboard in a real headless Chromium (Debian's `chromium`, driven by `playwright-core`)
 * against a real 3-node mesh on loopback (createDaemon with identities, as `shoal node` runs it):
 * the page loads, shows the three nodes admitted and alive, the model served by replicas and the
 * requests just made with a verify button whose server-side check passes; when a node leaves, the
 * page — without a reload — shows it stop being alive; when the node behind the page stops, the
 * page's event stream ends cleanly and the page says it is reconnecting.
 *
 * Skips, saying why, when no Chromium or no playwright-core can be found (test/support/browser.ts).
 * The same page on a node that requires client keys: test/ingress/dashboard-browser.test.ts.
 * SHOAL_DASHBOARD_SCREENSHOT=path writes a screenshot of the 3-node page there.
 */
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createThrowawayCa } from '../../certs/index.ts'
import { MODEL_ID, makeTinyCheckpoint } from '../e2e/daemon.ts'
import type { TinyCheckpoint } from '../e2e/daemon.ts'
import { browserMissing, launchBrowser, pageWait as waitInPage } from '../support/browser.ts'
import type { PwBrowser, PwPage } from '../support/browser.ts'
import { clientFor, sees, startInProcess, waitFor } from './harness.ts'
import type { MeshNode } from './harness.ts'

const why = browserMissing
if (why !== undefined) console.warn(`dashboard browser test skipped: ${why}`)

let ck: TinyCheckpoint
let nodes: MeshNode[] = []
let browser: PwBrowser | undefined
let page: PwPage

const pageWait = async (what: string, expression: string, timeout?: number): Promise<void> => await waitInPage(page, what, expression, timeout)

describe.skipIf(why !== undefined)('the dashboard in headless Chromium', () => {
  beforeAll(async () => {
    ck = await makeTinyCheckpoint({ compile: true })
    const ca = await createThrowawayCa(join(ck.root, 'pki'), ['node-1', 'node-2', 'node-3'])
    const [a, b, c] = ca.identities
    const first = await startInProcess({ name: 'node-1', identityDir: a!.dir, root: ck.root, model: ck.shardDir, api: true, bootstrap: [] })
    nodes = [
      first,
      await startInProcess({ name: 'node-2', identityDir: b!.dir, root: ck.root, model: ck.shardDir, api: true, bootstrap: first.addrs }),
      await startInProcess({ name: 'node-3', identityDir: c!.dir, root: ck.root, model: ck.shardDir, api: false, bootstrap: first.addrs }),
    ]
    await waitFor('node-1 to see both peers alive with the model', async () => await sees(first.url!, nodes.slice(1).map(n => n.peerId), MODEL_ID))
    // Requests to list (and a receipt to verify).
    const client = clientFor(first.url!)
    for (let i = 0; i < 3; i++) await client.completions.create({ model: MODEL_ID, prompt: `Hello ${i}`, max_tokens: 8, temperature: 0 })
    browser = await launchBrowser()
    page = await browser.newPage()
    await page.setViewportSize({ width: 1280, height: 820 })
  }, 180_000)

  afterAll(async () => {
    await browser?.close().catch(() => {})
    for (const n of [...nodes].reverse()) await n.stop().catch(() => {})
    await ck?.cleanup()
  })

  it('loads and shows the 3-node mesh, the model on its replicas and the recent requests', async () => {
    await page.goto(`${nodes[0]!.url!}/`)
    await pageWait('the live state', "document.querySelector('#status').classList.contains('live')")
    await pageWait('three admitted, alive nodes',
      "document.querySelectorAll('#mesh tbody tr[data-admitted=\"true\"][data-state=\"alive\"]').length === 3")
    const ids = await page.evaluate<string[]>("[...document.querySelectorAll('#mesh tbody tr')].map(r => r.dataset.peerId)")
    expect(new Set(ids)).toEqual(new Set(nodes.map(n => n.peerId)))
    const text = await page.evaluate<string>("document.querySelector('#mesh').innerText")
    for (const n of nodes) expect(text).toContain(n.name)
    expect(await page.evaluate<string>(`document.querySelector('#models [data-model="${MODEL_ID}"]').innerText`)).toContain('replicas')
    expect(await page.evaluate<number>("document.querySelectorAll('#topology circle').length")).toBe(3)
    await pageWait('the three requests', "document.querySelectorAll('#requests tbody tr[data-receipt]').length >= 3")
    if (process.env.SHOAL_DASHBOARD_SCREENSHOT !== undefined) await page.screenshot({ path: process.env.SHOAL_DASHBOARD_SCREENSHOT })
  })

  it('the verify button checks a receipt\'s signature and chain link on the server', async () => {
    await page.click('#requests tbody tr[data-receipt] button.verify')
    await pageWait('a verdict', "document.querySelector('#requests .verdict') !== null")
    expect(await page.evaluate<string | undefined>("document.querySelector('#requests .verdict').dataset.ok")).toBe('true')
  })

  it('updates without a reload when a node leaves', async () => {
    await page.evaluate("window.__sameDocument = true")
    const leaving = nodes[2]!
    await leaving.stop()
    // Suspect within seconds, dropped later: either way no longer shown alive.
    await pageWait(`${leaving.name} no longer alive`,
      `!document.querySelector('#mesh tbody tr[data-peer-id="${leaving.peerId}"][data-state="alive"]')`, 60_000)
    expect(await page.evaluate<boolean>('window.__sameDocument === true')).toBe(true)
    expect(await page.evaluate<number>("document.querySelectorAll('#mesh tbody tr[data-admitted=\"true\"][data-state=\"alive\"]').length")).toBe(2)
  }, 90_000)

  it('when its node stops, the page\'s stream ends cleanly and the page says so', async () => {
    await nodes[0]!.stop()
    await pageWait('that it is no longer live', "!document.querySelector('#status').classList.contains('live')")
  })
})
