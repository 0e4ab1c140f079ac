"""Scrapy on the demo shop: a spider following the listing pages' pagination and items, with
Scrapy's default settings, each product's fields to a JSON-lines feed.

    python scrapy_shop.py BASE WORKDIR

Prints the number of items written to WORKDIR/items.jsonl."""
import sys

import scrapy
from scrapy.crawler import CrawlerProcess


class Shop(scrapy.Spider):
    name = "shop"

    def __init__(self, base, **kwargs):
        super().__init__(**kwargs)
        self.start_urls = [f"{base}/list/1"]

    def parse(self, response):
        for href in response.css(".item a::attr(href)").getall():
            yield response.follow(href, self.parse_product)
        for href in response.css("a.next::attr(href)").getall():
            yield response.follow(href, self.parse)

    def parse_product(self, response):
        yield {
            "sku": response.css(".sku::text").get(),
            "title": response.css("h1::text").get(),
            "price": response.css(".price::text").get(),
            "status": response.css(".status::text").get(),
        }


if __name__ == "__main__":
    base, workdir = sys.argv[1], sys.argv[2]
    feed = f"{workdir}/items.jsonl"
    process = CrawlerProcess(
        settings={
            "FEEDS": {feed: {"format": "jsonlines"}},
            "LOG_LEVEL": "WARNING",
            "TELNETCONSOLE_ENABLED": False,
        }
    )
    process.crawl(Shop, base=base)
    process.start()
    with open(feed) as f:
        print(sum(1 for _ in f))
