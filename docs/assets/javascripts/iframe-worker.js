/*
 * Search for the site opened from disk (file://), taskpoint's own stand-in for Web Workers.
 *
 * Material runs its search in a Web Worker, and browsers refuse to start a worker from a
 * file:// page. With the `offline` plugin (mkdocs.yml) the search index comes as a script;
 * this file gives the worker somewhere to run: on a file:// page, `new Worker(url)` loads
 * the worker's script into a hidden frame of the same page instead, and messages go both
 * ways through that frame. Served over http(s) it does nothing. Material would otherwise
 * load a shim for this from a CDN, which the site must not reach; the name of this file
 * ("iframe-worker") tells the plugin one is present.
 */
(function () {
  "use strict";
  if (location.protocol !== "file:") {
    return;
  }

  class FrameWorker extends EventTarget {
    constructor(url) {
      super();
      this.onmessage = null;
      this.onerror = null;
      this._pending = [];
      this._frame = document.createElement("iframe");
      this._frame.style.display = "none";
      document.documentElement.appendChild(this._frame);
      const inner = this._frame.contentWindow;
      // What the worker's script calls `postMessage` answers this object's listeners.
      inner.postMessage = (data) => this._deliver(structuredClone(data));
      const script = inner.document.createElement("script");
      script.src = new URL(url, location.href).href;
      script.onload = () => {
        const pending = this._pending;
        this._pending = null;
        pending.forEach((data) => this._send(data));
      };
      script.onerror = () => {
        const event = new Event("error");
        this.dispatchEvent(event);
        if (typeof this.onerror === "function") {
          this.onerror(event);
        }
      };
      inner.document.head.appendChild(script);
    }

    postMessage(data) {
      if (this._pending === null) {
        this._send(data);
      } else {
        this._pending.push(data);
      }
    }

    terminate() {
      this._frame.remove();
    }

    _send(data) {
      const inner = this._frame.contentWindow;
      // Cloned in the frame, so the script's objects are of its own realm.
      inner.dispatchEvent(new inner.MessageEvent("message", { data: inner.structuredClone(data) }));
    }

    _deliver(data) {
      const event = new MessageEvent("message", { data: data });
      this.dispatchEvent(event);
      if (typeof this.onmessage === "function") {
        this.onmessage(event);
      }
    }
  }

  window.Worker = FrameWorker;
})();
