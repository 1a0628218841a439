/**
 * A real headless Chromium (Debian's `chromium`, driven by `playwright-core`) for the dashboard's
 * browser tests. `browserMissing` says why a test must skip when no Chromium or no playwright-core
 * can be found: CHROMIUM_PATH or /usr/bin/chromium, and playwright-core from node_modules or
 * NODE_PATH.
 */
import { existsSync } from 'node:fs'
import { createRequire } from 'node:module'

export interface PwPage {
  goto (url: string): Promise<unknown>
  evaluate<T> (fn: string): Promise<T>
  click (selector: string): Promise<void>
  fill (selector: string, value: string): Promise<void>
  screenshot (options: { path: string, fullPage?: boolean }): Promise<unknown>
  setViewportSize (size: { width: number, height: number }): Promise<void>
}
export interface PwBrowser { newPage (): Promise<PwPage>, close (): Promise<void> }
interface Playwright { chromium: { launch (options: { executablePath: string, headless: boolean, args?: string[] }): Promise<PwBrowser> } }

const CHROMIUM = [process.env.CHROMIUM_PATH, '/usr/bin/chromium', '/usr/bin/chromium-browser'].find(p => p !== undefined && p !== '' && existsSync(p))

function loadPlaywright (): Playwright | string {
  try {
    // createRequire resolves through node_modules and NODE_PATH (a driver kept outside the repo).
    return createRequire(import.meta.url)('playwright-core') as Playwright
  } catch {
    return 'playwright-core is not installed (npm i -D playwright-core, or point NODE_PATH at a directory holding it)'
  }
}
const playwright = loadPlaywright()

/** Why no browser test can run here, or undefined when one can. */
export const browserMissing: string | undefined = CHROMIUM === undefined
  ? 'no Chromium found (apt-get install chromium, or set CHROMIUM_PATH)'
  : typeof playwright === 'string' ? playwright : undefined

export async function launchBrowser (): Promise<PwBrowser> {
  if (browserMissing !== undefined) throw new Error(browserMissing)
  return await (playwright as Playwright).chromium.launch({ executablePath: CHROMIUM!, headless: true, args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage'] })
}

/**
 * Waits for an expression to be true in the page (a deadline, not a timing assertion). Polled from
 * here: the page's CSP forbids eval, which playwright's in-page polling would need. On timeout the
 * error carries the page's text.
 */
export async function pageWait (page: PwPage, what: string, expression: string, timeout = 30_000): Promise<void> {
  const deadline = Date.now() + timeout
  while (!await page.evaluate<boolean>(expression)) {
    if (Date.now() > deadline) {
      const text = await page.evaluate<string>('document.body.innerText').catch(() => '?')
      throw new Error(`page never showed ${what} within ${timeout} ms\n--- page text ---\n${text}`)
    }
    await new Promise(resolve => setTimeout(resolve, 100))
  }
}
